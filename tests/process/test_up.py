"""``weightcast up``: the whole pipeline end to end (the one test that runs all of it), and its
behaviour when a process fails or it is interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import redis
import torch

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.manifest import Manifest, sha256_bytes, sha256_file, verify_files
from weightcast.contract.nodes import NodeReport
from weightcast.contract.sharding import ShardKind
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server
from weightcast.local.up import FOLLOWER_ID, NODE_WEIGHTS_DIR
from weightcast_trainer.settings import TrainerConfig

from helpers.files import REPO
from helpers.models import save_pretrained_qwen3
from helpers.processes import clean_env, run_weightcast, stop, weightcast
from helpers.s3 import s3_client
from helpers.up_runs import start_and_late_reward, summary_rows


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment mentions ``text`` (a run directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            seen = (
                Path(f"/proc/{pid}/cmdline").read_bytes()
                + Path(f"/proc/{pid}/environ").read_bytes()
            )
        except OSError:
            continue
        if text.encode() in seen and int(pid) != os.getpid():
            found.append(int(pid))
    return found


UP_STEPS = 30
PUBLISH_EVERY = 2  # up's default


def run_up(
    redis_server: RedisServer, keys: Keys, workdir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``weightcast up ARGS`` on the test's Redis and namespace (so the registry can be read
    back), its runs under ``workdir``."""
    env = {**clean_env(), "WEIGHTCAST_REDIS_URL": redis_server.url}
    return run_weightcast(
        env,
        "up",
        *args,
        "--workdir",
        str(workdir),
        "--redis-url",
        redis_server.url,
        "--namespace",
        keys.namespace,
        timeout=600,
    )


def test_up_runs_an_rl_loop_whose_reward_rises(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The whole pipeline, once, through real processes: the node samples from real
    versions, the trainer learns, the reward goes up; what it leaves in Redis and on disk is
    whole and agrees with the operator's view.

    The reward is a statistical check: with the fixed seeds the toy reward starts near 1/32
    (uniform sampling) and passes 0.3 within 30 steps on every run seen; a broken loop (wrong
    sign, stale weights, misaligned logprobs) leaves it flat. ``up`` runs on the test's Redis
    so that the registry can be read back (its private redis-server: the Ctrl-C test).
    """
    result = run_up(redis_server, keys, tmp_path, "--steps", str(UP_STEPS))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"using {redis_server.url}, namespace {keys.namespace}" in out
    assert f"trained {UP_STEPS} steps" in out
    published = re.search(r"(\d+) versions published, (\d+) evicted, live: (.*)", out)
    assert published, out
    count, evicted, live = int(published[1]), int(published[2]), published[3].split()
    assert evicted == count - 2
    # A snapshot every 2 steps: each one is published, or skipped under load and counted.
    skipped = re.search(r"snapshots skipped under load: (\d+) by the trainer .*, (\d+) by the", out)
    assert skipped, out
    assert count + int(skipped[1]) + int(skipped[2]) == UP_STEPS // PUBLISH_EVERY, out
    assert count >= UP_STEPS // 4, out  # skipping is the exception, not the rule
    assert live == [f"v{count - 1}", f"v{count}"]
    assert f"the inference node loaded v{count}; 0 batches dead-lettered" in out
    rows = summary_rows(out)
    assert [v for v, *_ in rows] == list(range(count + 1)), out  # v0 = uniform, then all
    steps = {v: int(step) for v, step, _, _ in rows[1:]}
    # Every version registered once, in order, each from a newer snapshot; the last holds
    # the last step.
    assert list(steps.values()) == sorted(set(steps.values()))
    assert all(step % PUBLISH_EVERY == 0 for step in steps.values())
    assert steps[count] == UP_STEPS

    # Every trained batch carries a real version: 0 (uniform) or a version published before
    # the step that trained it.
    (run_dir,) = tmp_path.iterdir()
    log = (run_dir / "logs/trainer.log").read_text()
    trained = [
        (int(step), int(version))
        for step, versions in re.findall(r"step step=(\d+) .*policy_versions=([\d,]+)", log)
        for version in versions.split(",")
    ]
    assert [s for s, _ in trained] == list(range(1, UP_STEPS + 1))
    for step, version in trained:
        assert version == 0 or steps[version] < step, (step, version)
    assert max(v for _, v in trained) >= count - 4  # the node kept up with the trainer
    # The staleness guard measures real lags: behind the newest version, within the bound.
    lags = [int(lag) for lag in re.findall(r"step step=\d+ .*policy_lag=(\d+)", log)]
    assert len(lags) == UP_STEPS and max(lags) >= 1, lags
    assert max(lags) <= TrainerConfig().max_policy_lag and "dropped a stale batch" not in log

    start, late = start_and_late_reward(out)
    assert start < 0.15 and late > 0.3, out
    assert "mean reward:" in out

    # Exactly the two newest remain live, in Redis and on disk; the evicted ones on the
    # newest's chain of deltas stay delta-only (publisher.delta_window), every other is gone.
    newest = [count - 1, count]
    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == newest
    assert int(client.get(keys.latest)) == count
    weights = run_dir / "weights"
    deltas = [int(v) for v in client.zrange(keys.deltas, 0, -1)]
    assert len(deltas) <= 8 and all(v < count - 1 for v in deltas)
    assert sorted(p.name for p in weights.iterdir()) == sorted(live + [f"v{v}" for v in deltas])
    gone = [v for v in range(1, count - 1) if v not in deltas]
    assert not any(client.exists(keys.version(v)) for v in gone)
    # Every registered entry names a whole directory (relative to the weights directory)
    # that matches its manifest, and its manifest's digest.
    for version in newest:
        fields = {k.decode(): v.decode() for k, v in client.hgetall(keys.version(version)).items()}
        assert fields["path"] == f"v{version}"
        manifest = Manifest.read(weights / fields["path"])
        verify_files(weights / fields["path"], manifest)
        assert sha256_file(weights / fields["path"] / "manifest.json") == fields["manifest_sha256"]
        assert (manifest.version, manifest.step, manifest.tp, manifest.total_bytes) == (
            version,
            int(fields["step"]),
            int(fields["tp"]),
            int(fields["bytes"]),
        )
    # Every delivered batch was trained and acknowledged; handled snapshots were pruned to
    # the newest two written.
    assert int(client.hget(keys.trainer_heartbeat, "step")) == UP_STEPS
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
    not_written = {int(s) for s in re.findall(r"snapshot skipped.* step=(\d+)", log)}
    written = [s for s in range(PUBLISH_EVERY, UP_STEPS + 1, PUBLISH_EVERY) if s not in not_written]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == sorted(f"step-{step}" for step in written[-2:])

    # The operator's view agrees with what happened.
    status = run_weightcast(
        {
            **clean_env(),
            "WEIGHTCAST_REDIS_URL": redis_server.url,
            "WEIGHTCAST_NAMESPACE": keys.namespace,
        },
        "status",
        "--json",
    )
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["latest"] == count
    assert [v["version"] for v in view["versions"]] == newest
    assert view["trainer"]["step"] == str(UP_STEPS)
    assert (view["stream"]["pending"], view["stream"]["dead_letters"]) == (0, 0)
    assert processes_mentioning(str(run_dir)) == []


def test_up_stops_everything_and_names_the_process_that_failed(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[trainer.optimizer]\nname = "NoSuchOptimizer"\n')
    env = clean_env()
    result = run_weightcast(
        env,
        "up",
        "--config",
        str(config),
        "--steps",
        "4",
        "--workdir",
        str(tmp_path / "runs"),
        timeout=600,
    )
    assert result.returncode == 1
    assert "weightcast up failed: the trainer exited with code 1" in result.stderr
    assert "Optimizer NoSuchOptimizer not added" in result.stderr  # the log's last lines
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert processes_mentioning(str(run_dir)) == []  # publisher, node, redis all stopped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process(tmp_path: Path, sig: signal.Signals) -> None:
    env = clean_env()
    up = subprocess.Popen(
        weightcast("up", "--steps", "500", "--workdir", str(tmp_path), "--timeout", "120"),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started = ""
    for line in up.stdout:
        started += line
        if re.search(r"published v\d+ ", line):  # every process is up, a version went through
            break
    up.send_signal(sig)
    code = up.wait(timeout=60)
    rest = up.stdout.read()
    assert code == 130, rest
    assert "started a private redis-server at redis://127.0.0.1:" in started
    assert "interrupted: stopped every process weightcast up started" in rest
    (run_dir,) = tmp_path.iterdir()
    assert processes_mentioning(str(run_dir)) == []


INTERRUPT_ROUNDS = 2
INTERRUPT_EXIT_S = 30.0
"""A stop with a second signal kills at once; even a graceful one ends within
``STOP_GRACE_S`` (20 s) and the redis-server's stop."""


def test_repeated_signals_at_random_points_never_hang_up(tmp_path: Path) -> None:
    """Issue 28: a signal raised as ``KeyboardInterrupt`` inside ``Popen.poll()`` leaked the
    child's wait lock and hung ``up`` for good. Here each round sends two to six SIGINTs and
    SIGTERMs at random moments of the watch loop and of the stop that follows (the later
    ones escalate to SIGKILL); ``up`` exits 130 within the bound every time, its processes
    and its private redis-server gone."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for round_ in range(INTERRUPT_ROUNDS):
        workdir = tmp_path / f"round{round_}"
        up = subprocess.Popen(
            weightcast("up", "--steps", "500", "--workdir", str(workdir), "--timeout", "120"),
            env=clean_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        seen, rest, sent = "", "", []
        try:
            for line in up.stdout:
                seen += line
                if re.search(r"published v\d+ ", line):  # every process is busy, not starting
                    break
            time.sleep(rng.uniform(0.0, 2.0))
            sent = [rng.choice([signal.SIGINT, signal.SIGTERM]) for _ in range(rng.randint(2, 6))]
            for sig in sent:
                up.send_signal(sig)
                time.sleep(rng.uniform(0.0, 0.3))
            code = up.wait(timeout=INTERRUPT_EXIT_S)
            rest = up.stdout.read()
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop(up, signal.SIGKILL)
            left = processes_mentioning(str(workdir))
            for pid in left:  # a hung up's children live in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        what = f"seed {seed}, round {round_}, sent {[s.name for s in sent]}:\n{seen}{rest}"
        # A signal landing after the stop, while the interpreter exits (its finalisation
        # restores the default handlers), may end it by that signal: harmless then.
        assert code in (130, -signal.SIGINT, -signal.SIGTERM), what
        assert "interrupted: stopped every process weightcast up started" in rest, what
        assert left == [], what


def test_up_rides_out_a_redis_restart_like_the_processes_it_started(
    keys: Keys, tmp_path: Path
) -> None:
    """The Redis under a running ``up --redis-url`` (AOF on) stops for four seconds and comes
    back: ``up`` waits it out as its trainer, publisher and node do, and finishes the run."""
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    steps = 10
    up = subprocess.Popen(
        weightcast(
            "up",
            "--steps",
            str(steps),
            "--workdir",
            str(tmp_path / "runs"),
            "--redis-url",
            server.url,
            "--namespace",
            keys.namespace,
            "--timeout",
            "400",
        ),
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        started = ""
        for line in up.stdout:
            started += line
            if re.search(r"published v\d+ ", line):  # every process is up, a version went through
                break
        server.stop()
        time.sleep(4)
        server.start()
        rest = up.stdout.read()
        assert up.wait(timeout=60) == 0, started + rest
    finally:
        stop(up)
        server.stop()
    assert "Redis unreachable; retrying" in rest and "Redis is back" in rest, rest
    assert f"trained {steps} steps" in rest
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert processes_mentioning(str(run_dir)) == []


def test_up_runs_the_loop_from_a_users_checkpoint(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """``up --init-from DIR`` with the transformers rollout node: the trainer starts from the
    ``save_pretrained`` directory, v1 is that directory (step 0) and the node samples from it
    and every version after; the summary has the mismatch column."""
    start = save_pretrained_qwen3(tmp_path / "start", "untied-odd", torch.bfloat16)
    result = run_up(
        redis_server, keys, tmp_path / "runs", "--init-from", str(start), "--steps", "6"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "started from a checkpoint" in trainer_log and "published the start" in trainer_log
    assert "train/infer KL" in result.stdout and "0 batches dead-lettered" in result.stdout
    assert re.search(r"^  v1\s+0\s", result.stdout, re.MULTILINE), result.stdout  # the start
    config = json.loads((run_dir / "checkpoints" / "step-6" / "config.json").read_text())
    assert config["vocab_size"] == 1003 and config["head_dim"] == 32


def test_up_runs_the_loop_on_a_tiny_mixture_of_experts(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """``up --model tiny-moe``: the trainer trains the MoE, the publisher writes vLLM's
    ``FusedMoE`` layout, and the transformers rollout node unfuses every version into
    ``Qwen3MoeForCausalLM`` (it refuses none) and loads the last one."""
    result = run_up(redis_server, keys, tmp_path, "--model", "tiny-moe", "--steps", "6")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    published = re.search(r"trained 6 steps; (\d+) versions published", out)
    assert published, out
    last = int(published[1])  # 3, fewer where a snapshot was skipped under load
    assert f"the inference node loaded v{last}; 0 batches dead-lettered" in out, out
    (run_dir,) = tmp_path.iterdir()
    assert "refusing version" not in (run_dir / "logs" / "follower.log").read_text()
    sampled = re.findall(r"^  v([1-9]\d*)\s+\d+\s+[\d.]+s\s+([1-9]\d*)\s", out, re.MULTILINE)
    assert sampled, out  # rollouts from published versions, not only the uniform start
    manifest = Manifest.read(run_dir / "weights" / f"v{last}")
    verify_files(run_dir / "weights" / f"v{last}", manifest)
    experts = [t for t in manifest.tensors if t.shard.kind == ShardKind.EXPERTS]
    assert {t.name for t in experts} == {
        f"model.layers.{layer}.mlp.experts.routed_experts.{w}"
        for layer in range(2)
        for w in ("w13_weight", "w2_weight")
    }
    assert (manifest.tp, manifest.ep) == (1, 1)


def test_up_with_store_s3_runs_the_loop_through_a_private_bucket(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """``up --store s3``: a private SeaweedFS beside the processes; the publisher uploads
    every version to its bucket and the node, whose weights directory is its own and stays
    empty, loads them from the bucket alone. At an RL run's learning rate (1e-5: the demo's
    1e-2 moves every value each step, and no delta pays) every version after the first has
    its delta and the node takes each by delta (or a chain of them, when it skipped one).
    Stopped with the rest; its data stays in the run directory, where a new server over it
    shows the live versions whole."""
    result = run_up(redis_server, keys, tmp_path, "--store", "s3", "--steps", "6", "--lr", "1e-5")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "started a private S3 server (SeaweedFS)" in out, out
    published = re.search(r"trained 6 steps; (\d+) versions published", out)
    assert published, out
    last = int(published[1])
    assert f"the inference node loaded v{last}; 0 batches dead-lettered" in out, out
    (run_dir,) = tmp_path.iterdir()
    logs = run_dir / "logs"
    assert "weights=s3://weights/run/" in (logs / "follower.log").read_text()
    assert (logs / "publisher.log").read_text().count("uploaded version") == last
    deltas = re.findall(
        r"published version version=(\d+) .* delta_bytes=(\d+)", publisher_log(logs)
    )
    assert len(deltas) == last and [v for v, n in deltas if n == "0"] == ["1"], deltas
    loads = re.findall(
        r"loaded version version=(\d+) .* via=(\w+)", (logs / "follower.log").read_text()
    )
    assert loads[0][1] == "full" and {via for _, via in loads[1:]} <= {"delta", "chain"}, loads
    assert len(loads) >= 2, loads
    report = NodeReport.parse(client.hget(keys.nodes, FOLLOWER_ID))
    assert report.version == last and report.read_bytes > 0, report
    assert list((run_dir / NODE_WEIGHTS_DIR).iterdir()) == []  # the node had no directory
    assert not processes_mentioning(str(run_dir))  # the S3 server stopped with the rest

    live = sorted(int(v) for v in client.zrange(keys.versions, 0, -1))
    assert live == [last - 1, last]
    with S3Server(run_dir / "s3", grace=3.0) as server:
        listed = s3_client(server).list_objects_v2(Bucket="weights", Prefix="run/")
        names = {o["Key"] for o in listed["Contents"]}
        for version in live:
            registered = client.hget(keys.version(version), "manifest_sha256").decode()
            body = s3_client(server).get_object(
                Bucket="weights", Key=f"run/v{version}/manifest.json"
            )
            assert sha256_bytes(body["Body"].read()) == registered
    assert {name.split("/")[1] for name in names} == {f"v{v}" for v in live}, names


def test_up_with_store_s3_names_the_extra_when_weed_is_missing(tmp_path: Path) -> None:
    """An environment without SeaweedFS (a venv of this Python's packages, no ``weed`` beside
    its Python nor on PATH): one line naming the extra, exit 2, nothing started."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(site) / "ours.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "weed").exists()
    )
    env = {**clean_env(), "PATH": path}
    done = subprocess.run(
        [
            str(python),
            "-m",
            "weightcast",
            "up",
            "--store",
            "s3",
            "--workdir",
            str(tmp_path / "runs"),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "pip install 'weightcast[s3-server]'" in line, line
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def publisher_log(logs: Path) -> str:
    return (logs / "publisher.log").read_text()
