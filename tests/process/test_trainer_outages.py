"""The trainer rides out a Redis restart and a full resume directory, losing and doubling
nothing, through real processes, a real redis-server with AOF and a real tmpfs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.net import free_port

from helpers.files import tmpfs
from helpers.processes import config_file, healthz, run_env, start_weightcast, stop, wait_for
from helpers.redis_state import dead_letters, heartbeat, pending, push_batches
from helpers.snapshots import final_train_state

OUTAGE_S = 3.0
"""How long Redis stays down: a restart, as an operator or an orchestrator does it."""


def test_a_redis_restart_mid_run_loses_and_doubles_no_batch(keys: Keys, tmp_path: Path) -> None:
    """Trainer, publisher and ``weightcast follow`` run while redis-server (AOF on) stops
    for three seconds and comes back: every batch is trained exactly once, no failed
    attempt is counted, ``/healthz`` says 503 meanwhile, the last step is published and
    followed by the same ``follow`` process, which rode the outage out too.
    """
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    client = redis.Redis.from_url(server.url)
    env = run_env(server.url, keys.namespace, tmp_path)
    count = 30
    produced = list(push_batches(server.url, keys, count))
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "trainer.log"
    publisher = start_weightcast(
        env, logs / "publisher.log", "publisher", "--rescan-seconds", "0.5"
    )
    follow = start_weightcast(env, logs / "follow.log", "follow", "--poll-seconds", "0.5")
    trainer = start_weightcast(
        env,
        log,
        "trainer",
        "--config",
        config_file(tmp_path, "[trainer.checkpoint]\ninterval = 4\n"),
        "--steps",
        str(count),
        "--publish-every",
        "3",
        "--max-policy-lag",
        "-1",
        "--metrics-port",
        str(port),
        "--consumer",
        "r",
    )
    try:
        wait_for(lambda: int(heartbeat(client, keys).get("step", 0)) >= 4, 300, "four steps")
        assert healthz(port) == 200
        server.stop()
        down = time.monotonic()
        wait_for(lambda: healthz(port) == 503, 60, "/healthz 503 while Redis is down")
        wait_for(lambda: "Redis unreachable; retrying" in log.read_text(), 60, "retries")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))
        server.start()
        assert trainer.wait(timeout=600) == 0, log.read_text()[-3000:]
        assert follow.poll() is None, (logs / "follow.log").read_text()[-3000:]
        wait_for(
            lambda: (
                (latest := client.get(keys.latest))
                and client.hget(keys.version(int(latest)), "step") == str(count).encode()
            ),
            300,
            "the last step published",
        )
        latest = int(client.get(keys.latest))
        wait_for(
            lambda: any(json.loads(node)["version"] == latest for node in client.hvals(keys.nodes)),
            300,
            "follow to load the last version",
        )
        assert publisher.poll() is None, (logs / "publisher.log").read_text()[-3000:]
        assert follow.poll() is None, (logs / "follow.log").read_text()[-3000:]
        assert "Redis unreachable; retrying" in (logs / "follow.log").read_text()
    finally:
        for process in (trainer, publisher, follow):
            stop(process)
        server.stop()
    server.start()  # read the state back from the AOF, as it was left
    try:
        text = log.read_text()
        assert "Redis is back" in text and "trainer started" in text
        assert text.count("trainer started") == 1  # ridden out, never restarted
        assert "counted a failed attempt" not in text
        state = final_train_state(tmp_path / "checkpoints-resume")
        assert state.applied_ids() == produced  # each once, in stream order
        assert dead_letters(client, keys) == {}
        assert pending(client, keys) == 0
        assert client.xinfo_groups(keys.batches)[0]["lag"] == 0
        assert client.hlen(keys.trainer_attempts) == 0 and client.hlen(keys.trainer_running) == 0
        assert heartbeat(client, keys)["step"] == str(count)
    finally:
        server.stop()


def test_a_full_resume_directory_acknowledges_nothing_and_is_retried_until_freed(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Resume checkpoints go to a 1 MiB tmpfs (one needs about 10): every save fails, the
    trainer goes on training, acknowledges nothing, says why, and at its last step keeps
    retrying; once the tmpfs is grown the checkpoint is written and everything acked."""
    with tmpfs(tmp_path / "resume", "1m") as resume:
        run_with_a_full_resume_directory(cli_env, client, keys, tmp_path, resume)


def run_with_a_full_resume_directory(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path, resume: Path
) -> None:
    produced = list(push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 8))
    port = free_port()
    log = tmp_path / "trainer.log"
    trainer = start_weightcast(
        cli_env,
        log,
        "trainer",
        "--resume-dir",
        str(resume),
        "--config",
        config_file(tmp_path, "[trainer.checkpoint]\ninterval = 2\n"),
        "--steps",
        "8",
        "--publish-every",
        "100",
        "--metrics-port",
        str(port),
    )
    try:
        wait_for(
            lambda: (
                trainer.poll() is not None
                or "retrying the last resume checkpoint" in log.read_text()
            ),
            300,
            "the last checkpoint to be retried",
        )
        assert trainer.poll() is None, log.read_text()[-3000:]
        text = log.read_text()
        assert text.count("resume checkpoint failed") >= 4  # steps 2, 4, 6 and the last
        assert f"(free space in {resume})" in text and "needed_bytes=" in text
        assert pending(client, keys) == len(produced)  # nothing acknowledged
        assert healthz(port) == 503
        assert int(heartbeat(client, keys)["checkpoint_failures"]) >= 4
        assert [p.name for p in resume.iterdir()] == []  # what the failed saves left is gone

        subprocess.run(["mount", "-o", "remount,size=64m", str(resume)], check=True)
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
        state = final_train_state(resume)
        assert state.applied_ids() == produced
        assert state.step == len(produced)
        assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
        assert client.xlen(keys.batches) == 0  # acknowledged, then trimmed
        assert heartbeat(client, keys)["last_checkpoint_error"] == ""
    finally:
        if trainer.poll() is None:
            trainer.kill()
