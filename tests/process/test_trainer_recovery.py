"""The trainer's exactly-once effect through real crashes, claims and shutdowns.

Each test runs ``weightcast trainer`` as a real process against the test's redis-server and
reads the final train state from the resume checkpoint on disk.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from torch.distributed.checkpoint.api import CheckpointException

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.streams import parse_stream_id
from weightcast.runtime.net import free_port
from weightcast_trainer.resume import newest_checkpoint, read_train_state

from helpers.processes import config_file, run_weightcast, start_weightcast, wait_for
from helpers.redis_state import heartbeat, pending, push_batches
from helpers.snapshots import final_train_state

CHECKPOINT_EVERY_2 = "[trainer.checkpoint]\ninterval = 2\n"


def start_trainer(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    return start_weightcast(env, log, "trainer", *args)


def partial_checkpoint(resume_dir: Path) -> str | None:
    """A resume checkpoint directory DCP is still writing (no ``.metadata`` yet)."""
    try:
        entries = list(os.scandir(resume_dir))
    except FileNotFoundError:
        return None
    for entry in entries:
        if entry.name.startswith("step-") and not os.path.exists(
            os.path.join(entry.path, ".metadata")
        ):
            return entry.name
    return None


def assert_each_applied_once_or_dead(
    client: redis.Redis, keys: Keys, resume_dir: Path, produced: dict[str, str]
) -> list[str]:
    """Every produced uid is in the final train state exactly once, or dead-lettered; the
    stream is empty, as every entry was acknowledged and so trimmed."""
    state = final_train_state(resume_dir)
    applied = collections.Counter(produced[entry] for entry in state.applied_ids())
    dead = {}
    for _, fields in client.xrange(keys.dead_letters):
        assert fields[b"reason"], fields
        dead[produced[fields[b"orig_id"].decode()]] = fields[b"reason"].decode()
    assert {uid: n for uid, n in applied.items() if n != 1} == {}, "trained more than once"
    assert not set(applied) & set(dead), "both trained and dead-lettered"
    assert set(applied) | set(dead) == set(produced.values()), "lost batches"
    assert state.step == len(state.applied_ids())  # one entry per step (micro_batches 1)
    assert pending(client, keys) == 0
    assert client.xinfo_groups(keys.batches)[0]["lag"] == 0
    assert client.xlen(keys.batches) == 0, "acknowledged entries were left in the stream"
    return list(dead.values())


@pytest.mark.parametrize(("async_mode", "kills"), [("disabled", 11), ("async", 10)])
def test_sigkill_at_random_moments_neither_loses_nor_repeats_a_batch(
    cli_env: dict[str, str],
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    async_mode: str,
    kills: int,
) -> None:
    produced = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 100)
    resume_dir = tmp_path / "checkpoints-resume"
    log = tmp_path / "trainer.log"
    args = (
        "--config",
        config_file(tmp_path, f'{CHECKPOINT_EVERY_2}async_mode = "{async_mode}"\n'),
        "--consumer",
        "crashy",
        "--publish-every",
        "3",
        "--max-attempts",
        "10",
    )
    rng = random.Random(3)
    killed_in_checkpoint = []
    for round_ in range(kills):
        starts = log.read_text().count("trainer started") if log.exists() else 0
        trainer = start_trainer(cli_env, log, *args)
        if round_ % 3 == 0:  # while DCP writes the k-th resume checkpoint of this run
            seen: set[str] = set()
            wanted = rng.randint(1, 4)
            deadline = time.monotonic() + 30
            while len(seen) < wanted and time.monotonic() < deadline and trainer.poll() is None:
                name = partial_checkpoint(resume_dir)
                if name:
                    seen.add(name)
                time.sleep(0.0005)
            if len(seen) == wanted:
                killed_in_checkpoint.append(partial_checkpoint(resume_dir))
        elif round_ % 3 == 1:  # a random moment of training
            wait_for(lambda s=starts: log.read_text().count("trainer started") > s, 60, "start")
            time.sleep(rng.uniform(0.0, 0.4))
        else:  # a random moment of start-up, loading or recovery
            time.sleep(rng.uniform(1.0, 5.0))
        assert trainer.poll() is None, log.read_text()[-3000:]
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL

    trainer = start_trainer(cli_env, log, *args)
    try:
        wait_for(
            lambda: (
                int(heartbeat(client, keys).get("step", -1)) + client.xlen(keys.dead_letters)
                >= len(produced)
            ),
            120,
            "every batch trained or dead-lettered",
            every=0.2,
        )
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()

    dead_reasons = assert_each_applied_once_or_dead(client, keys, resume_dir, produced)
    assert all("max_attempts" in reason for reason in dead_reasons)
    # At least one kill landed inside a resume checkpoint write, and it was recovered.
    assert [name for name in killed_in_checkpoint if name], killed_in_checkpoint
    assert "removed an unfinished resume checkpoint" in log.read_text()
    assert ("resume checkpoint started" in log.read_text()) == (async_mode == "async")
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_a_second_trainer_claims_and_trains_what_a_dead_one_left_pending(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    produced = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 8)
    config = config_file(tmp_path, "[trainer.checkpoint]\ninterval = 5\n")
    log = tmp_path / "trainer.log"
    first = start_trainer(cli_env, log, "--config", config, "--consumer", "first")
    try:
        # Eight steps trained; the checkpoint at step 5 acknowledged five of them.
        wait_for(lambda: "step=8 " in log.read_text(), 120, "eight steps")
        wait_for(lambda: pending(client, keys) == 3, 30, "three pending entries")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    wait_for(
        lambda: all(
            row["time_since_delivered"] > 1000
            for row in client.xpending_range(keys.batches, TRAINER_GROUP, "-", "+", 10)
        ),
        30,
        "the pending entries to be idle longer than --claim-idle-s",
    )

    second = run_weightcast(
        cli_env,
        "trainer",
        "--config",
        config,
        "--consumer",
        "second",
        "--claim-idle-s",
        "1",
        "--steps",
        "8",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "claimed idle entries count=3 consumer=second" in second.stderr
    trained_by_second = re.findall(r"step=\d+ .* entries=(\S+)", second.stderr)
    assert len(trained_by_second) == 3
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert state.applied_ids() == list(produced)  # in stream order, each once
    assert state.applied_ids()[5:] == trained_by_second
    assert pending(client, keys) == 0


def test_stale_batches_and_batches_that_failed_too_often_never_reach_training(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    # A batch three steps failed on (say three trainers died in them), and one delivered
    # many times without a failure (restarts between steps): only the first is refused.
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    (poison,) = push_batches(url, keys, 1, policy_version=10, prefix="poison")
    (redelivered,) = push_batches(url, keys, 1, policy_version=10, prefix="again")
    client.xreadgroup(TRAINER_GROUP, "t", {keys.batches: ">"})
    for _ in range(5):
        client.xreadgroup(TRAINER_GROUP, "t", {keys.batches: "0"})
    client.hset(keys.trainer_attempts, poison, 3)
    client.set(keys.latest, 10)
    fresh = push_batches(
        cli_env["WEIGHTCAST_REDIS_URL"], keys, 1, policy_version=10, prefix="fresh"
    )
    push_batches(
        cli_env["WEIGHTCAST_REDIS_URL"], keys, 1, policy_version=6, prefix="stale"
    )  # lag 4
    edge = push_batches(
        cli_env["WEIGHTCAST_REDIS_URL"], keys, 1, policy_version=7, prefix="edge"
    )  # lag 3: kept

    result = run_weightcast(
        cli_env,
        "trainer",
        "--consumer",
        "t",
        "--max-policy-lag",
        "3",
        "--max-attempts",
        "3",
        "--steps",
        "3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert state.applied_ids() == [redelivered, *fresh, *edge]
    (dead,) = client.xrange(keys.dead_letters)
    assert dead[1][b"orig_id"].decode() == poison
    assert dead[1][b"reason"].startswith(b"failed 3 attempts (trainer.max_attempts=3)")
    beat = heartbeat(client, keys)
    assert (beat["stale_dropped"], beat["dead_lettered"], beat["last_policy_lag"]) == (
        "1",
        "1",
        "3",
    )
    assert pending(client, keys) == 0
    assert client.hlen(keys.trainer_attempts) == 0


def test_sigterm_finishes_the_step_checkpoints_acks_and_a_restart_trains_the_rest(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    produced = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 30)
    log = tmp_path / "trainer.log"
    port = free_port()
    trainer = start_trainer(
        cli_env, log, "--consumer", "c", "--publish-every", "100", "--metrics-port", str(port)
    )
    try:
        wait_for(lambda: "step=3 " in log.read_text(), 120, "three steps")
        # While it runs: Prometheus metrics and a healthy /healthz.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        step = re.search(r"^weightcast_trainer_step (\S+)$", metrics, re.MULTILINE)
        assert step and float(step[1]) >= 3, metrics
        assert "weightcast_trainer_publish_skipped" in metrics
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            assert reply.status == 200 and json.loads(reply.read())["ok"] is True
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert 3 <= state.step < len(produced)
    assert "resume checkpoint step=" in log.read_text()
    # Everything trained is acknowledged; at most the one entry read for the next step waits.
    still_pending = {
        row["message_id"].decode()
        for row in client.xpending_range(keys.batches, TRAINER_GROUP, "-", "+", 10)
    }
    assert len(still_pending) <= 1 and not still_pending & set(state.applied_ids())

    result = run_weightcast(cli_env, "trainer", "--consumer", "c", "--steps", str(len(produced)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_each_applied_once_or_dead(client, keys, tmp_path / "checkpoints-resume", produced)


def test_entries_a_checkpoint_holds_but_were_never_acked_are_acked_not_retrained(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The state a crash between a durable checkpoint and its XACK leaves behind."""
    first = list(push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 2))
    trained = run_weightcast(  # entries kept, to be copied below
        cli_env, "trainer", "--consumer", "x", "--steps", "2", "--no-trim-stream"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    # The same entries (same stream ids) delivered to "x" and never acknowledged, in a second
    # namespace whose trainer resumes from that checkpoint; plus one entry it never saw.
    other = Keys(f"{keys.namespace}-b")
    for entry_id, fields in client.xrange(keys.batches):
        client.xadd(other.batches, fields, id=entry_id)
    client.xgroup_create(other.batches, TRAINER_GROUP, id="0")
    client.xreadgroup(TRAINER_GROUP, "x", {other.batches: ">"})
    (new,) = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], other, 1, prefix="new")
    env = {**cli_env, "WEIGHTCAST_NAMESPACE": other.namespace}
    resumed = run_weightcast(env, "trainer", "--consumer", "x", "--steps", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    assert resumed.stderr.count("re-delivered entry is already applied") == 2
    assert re.findall(r"step=\d+ .* entries=(\S+)", resumed.stderr) == [new]
    assert final_train_state(tmp_path / "checkpoints-resume").applied_ids() == [*first, new]
    assert heartbeat(client, other)["already_applied"] == "2"
    assert pending(client, other) == 0


def test_an_entry_waiting_for_its_step_is_not_claimed_back_into_the_same_step(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """XAUTOCLAIM also returns this consumer's own idle entries: they must not be doubled."""
    (first,) = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 1)
    log = tmp_path / "trainer.log"
    args = ("--micro-batches", "2", "--claim-idle-s", "0.5", "--steps", "1", "--consumer", "w")
    trainer = start_trainer(cli_env, log, *args)
    try:
        # The first entry waits for a second one while claims run every quarter second.
        wait_for(
            lambda: trainer.poll() is not None or log.read_text().count("claimed idle") >= 3,
            60,
            "claims",
        )
        (second,) = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 1, prefix="second")
        assert trainer.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert final_train_state(tmp_path / "checkpoints-resume").applied_ids() == [first, second]
    assert pending(client, keys) == 0


def test_async_checkpoint_entries_are_acked_only_once_it_is_complete(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Watch Redis and the resume directory while checkpoints are written in the background.

    At every look, each acknowledged entry is in the newest complete checkpoint; some looks
    find a checkpoint still being written while the entry it holds is pending; SIGTERM ends
    with the one in flight complete and acknowledged.
    """
    produced = list(push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 60))
    resume_dir = tmp_path / "checkpoints-resume"
    log = tmp_path / "trainer.log"
    config = config_file(tmp_path, '[trainer.checkpoint]\ninterval = 1\nasync_mode = "async"\n')
    trainer = start_trainer(
        cli_env, log, "--config", config, "--consumer", "a", "--publish-every", "100"
    )
    read: dict[int, list[str]] = {}  # step -> applied ids of that complete checkpoint
    in_flight: list[tuple[int, set[str]]] = []  # unfinished step-N seen, pending ids then
    checked = 0
    try:
        while int(heartbeat(client, keys).get("step", 0)) < 40:
            assert trainer.poll() is None, log.read_text()[-3000:]
            group = client.xinfo_groups(keys.batches)[0]
            delivered = parse_stream_id(group["last-delivered-id"])
            rows = client.xpending_range(keys.batches, TRAINER_GROUP, "-", "+", 1000)
            still_pending = {row["message_id"].decode() for row in rows}
            acked = {
                e for e in produced if parse_stream_id(e) <= delivered and e not in still_pending
            }
            partial = partial_checkpoint(resume_dir)
            if partial:
                in_flight.append((int(partial.removeprefix("step-")), still_pending))
            if acked:
                step, applied = newest_applied(resume_dir, read)
                assert acked <= set(applied), f"acked, not in step-{step}: {acked - set(applied)}"
                checked += 1
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()

    text = log.read_text()
    trained = re.findall(r"step=\d+ .* entries=(\S+)", text)
    state = final_train_state(resume_dir)
    assert state.applied_ids() == trained and len(trained) >= 40
    assert partial_checkpoint(resume_dir) is None
    still_pending = {
        row["message_id"].decode()
        for row in client.xpending_range(keys.batches, TRAINER_GROUP, "-", "+", 10)
    }
    assert len(still_pending) <= 1 and not still_pending & set(trained)
    # Each checkpoint read holds exactly the entries of its steps: the ids at save time.
    assert checked and all(applied == trained[:step] for step, applied in read.items())
    assert any(trained[step - 1] in pending_then for step, pending_then in in_flight), in_flight
    assert text.count("resume checkpoint started") >= 40
    assert heartbeat(client, keys)["checkpoint_step"] == str(state.step)


def newest_applied(resume_dir: Path, read: dict[int, list[str]]) -> tuple[int, list[str]]:
    """The step and applied ids of the newest complete checkpoint (retried if it is purged)."""
    for _ in range(10):
        found = newest_checkpoint(resume_dir)
        assert found is not None, "entries acknowledged without a complete checkpoint"
        step, path = found
        if step not in read:
            try:
                read[step] = read_train_state(path).applied_ids()
            except (OSError, CheckpointException):
                continue  # deleted by retention while being read
        return step, read[step]
    raise AssertionError(f"could not read a complete checkpoint in {resume_dir}")
