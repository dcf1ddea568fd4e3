"""Plain `docker compose up` for real, on CPU: the committed .env's demo profile runs the whole
loop from an image built from this checkout. The trainer is restarted in the middle, every
batch is accounted for at the end; then `--env-file s3.env up -d` moves the same stack to the
s3 profile's bucket, which a follower with no volume follows, and `down -v` (with s3.env)
leaves nothing behind.
The engine, base images and torch wheel come from conftest.py / compose_harness.py.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import yaml
from compose_harness import REPO, STATE, Engine, log, run

from weightcast.contract.keys import TRAINER_GROUP, Keys

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PROJECT = "wc-compose-test"
IMAGE = "weightcast:compose-test"  # layers shared with a user's weightcast:latest, tag not
LOOP = {
    "redis": "healthy",
    "trainer": "healthy",
    "publisher": "healthy",
    "producer": "running",
    "follower": "running",
}
NODES = ("demo-producer", "demo-follower")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose_environment(images: dict[str, str], torch: dict[str, str], port: int) -> dict:
    """The test's own variables over a clean environment: no COMPOSE_* (the committed .env
    must pick the profile) and no WEIGHTCAST_* of the caller's."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("COMPOSE_", "WEIGHTCAST_"))
    }
    return {
        **inherited,
        **images,
        **torch,
        "COMPOSE_PROJECT_NAME": PROJECT,
        "COMPOSE_BAKE": "false",  # Compose 2.40 would ask for buildx
        "WEIGHTCAST_IMAGE": IMAGE,
        "WEIGHTCAST_REDIS_PORT": f"127.0.0.1:{port}",
        "WEIGHTCAST_S3_PORT": f"127.0.0.1:{free_port()}",  # the s3 profile's server
        "WEIGHTCAST_TRAINER_PUBLISH_EVERY": "5",  # versions twice as often as the default
    }


class Stack:
    """The compose project under test, read through Docker and through Redis."""

    def __init__(self, engine: Engine, env: dict[str, str]) -> None:
        self.engine, self.env = engine, env
        port = int(env["WEIGHTCAST_REDIS_PORT"].rsplit(":", 1)[1])
        self.redis = redis.Redis(port=port)  # bytes: XINFO STREAM returns binary entries
        namespace = yaml.safe_load((REPO / "compose.yaml").read_text())["x-weightcast"][
            "environment"
        ]["WEIGHTCAST_NAMESPACE"]
        self.keys = Keys(namespace)
        self.timings: dict[str, float] = {}
        self.env_file: list[str] = []
        """``["--env-file", "s3.env"]`` once the s3 test switched the stack to the bucket."""

    def compose(self, *argv: str, timeout: float = 600, check: bool = True):
        command = [*self.engine.compose, *self.env_file, *argv]
        return run(*command, cwd=REPO, env=self.env, timeout=timeout, check=check)

    def containers(self) -> dict[str, dict[str, Any]]:
        """service -> `docker inspect` of its container (stopped ones included)."""
        ids = self.compose("ps", "-aq").stdout.split()
        rows = json.loads(run(self.engine.docker, "inspect", *ids).stdout) if ids else []
        return {row["Config"]["Labels"]["com.docker.compose.service"]: row for row in rows}

    def states(self) -> dict[str, str]:
        """service -> 'healthy r0', 'running r0', 'exited(0) r0'... (r: RestartCount)."""
        states = {}
        for service, row in self.containers().items():
            state = row["State"]
            status = (state.get("Health") or {}).get("Status") or state["Status"]
            if state["Status"] == "exited":
                status = f"exited({state['ExitCode']})"
            states[service] = f"{status} r{row['RestartCount']}"
        return states

    def group(self) -> dict[str, int]:
        """The trainer group's counts: added to the stream, read, pending, acknowledged."""
        group = next(
            g
            for g in self.redis.xinfo_groups(self.keys.batches)
            if g["name"].decode() == TRAINER_GROUP
        )
        return {
            "added": self.redis.xinfo_stream(self.keys.batches)["entries-added"],
            "read": group["entries-read"],
            "pending": group["pending"],
            "acked": group["entries-read"] - group["pending"],
        }

    def pending_ids(self) -> set[bytes]:
        pending = self.redis.xpending_range(self.keys.batches, TRAINER_GROUP, "-", "+", 100_000)
        return {entry["message_id"] for entry in pending}

    def latest(self) -> int:
        return int(self.redis.get(self.keys.latest) or 0)

    def heartbeat(self) -> dict[str, str]:
        fields = self.redis.hgetall(self.keys.trainer_heartbeat)
        return {key.decode(): value.decode() for key, value in fields.items()}

    def status(self) -> dict[str, Any]:
        """`weightcast status --json`, as an operator runs it (inside a container)."""
        out = self.compose("exec", "-T", "follower", "weightcast", "status", "--json", timeout=180)
        return json.loads(out.stdout)

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", *services).stdout

    def events(self, service: str, event: str) -> list[dict[str, Any]]:
        """The JSON log records of ``service`` (every container it had) named ``event``."""
        records = []
        for line in self.logs(service).splitlines():
            _, _, text = line.partition("| ")
            if text.startswith("{"):
                record = json.loads(text)
                if record.get("event") == event:
                    records.append(record)
        return records

    def wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` until it holds; fail with the containers' states after ``timeout``."""
        started, error = time.monotonic(), None
        while time.monotonic() - started < timeout:
            try:
                if ready():
                    self.timings[what] = round(time.monotonic() - started, 1)
                    log(f"{what}: {self.timings[what]} s")
                    return
            except (redis.RedisError, StopIteration) as exc:  # not up yet, no stream or group
                error = exc
            time.sleep(1)
        pytest.fail(f"{what}: not within {timeout} s; states {self.states()}; last {error!r}")


def without_restarts(states: dict[str, str]) -> dict[str, str]:
    restarted = {service: s for service, s in states.items() if not s.endswith(" r0")}
    assert not restarted, f"containers restarted by Docker: {restarted}"
    return states


@pytest.fixture(scope="module")
def stack(engine: Engine, base_images, torch_build_args) -> Iterator[Stack]:
    s = Stack(engine, compose_environment(base_images, torch_build_args, free_port()))
    s.compose("down", "-v", "--remove-orphans", check=False)  # what an interrupted run left
    started = time.monotonic()
    build = s.compose("build", timeout=3600, check=False)
    (STATE / "build.log").write_text(build.stdout + build.stderr)
    assert build.returncode == 0, f"build failed ({STATE / 'build.log'}):\n{build.stderr[-3000:]}"
    s.timings["build"] = round(time.monotonic() - started, 1)
    size = run(engine.docker, "image", "inspect", "--format", "{{.Size}}", IMAGE).stdout
    log(f"build: {s.timings['build']} s; {IMAGE} {int(size) / 1e9:.2f} GB")
    try:
        started = time.monotonic()
        s.compose("up", "-d", timeout=900)  # plain, as a user runs it: .env picks the profile
        s.timings["up -d"] = round(time.monotonic() - started, 1)
        yield s
    finally:
        logs = s.compose("logs", "--no-color", "--timestamps", check=False)
        (STATE / "compose-logs.txt").write_text(logs.stdout + logs.stderr)
        started = time.monotonic()
        s.compose("down", "-v", "--remove-orphans", "--timeout", "60", check=False)
        s.timings["down -v"] = round(time.monotonic() - started, 1)
        (STATE / "timings.json").write_text(json.dumps(s.timings, indent=1))
        log(f"timings {s.timings}")
        label = f"label=com.docker.compose.project={PROJECT}"
        left = {
            "containers": run(engine.docker, "ps", "-aq", "--filter", label).stdout.split(),
            "volumes": run(engine.docker, "volume", "ls", "-q", "--filter", label).stdout.split(),
            "networks": run(engine.docker, "network", "ls", "-q", "--filter", label).stdout.split(),
        }
        assert not any(left.values()), f"`docker compose down -v` left {left}"


def test_compose_up_runs_the_whole_loop_and_survives_a_trainer_restart(stack: Stack) -> None:
    s = stack

    def loop_healthy() -> bool:
        states = without_restarts(s.states())
        assert set(states) == set(LOOP), f"services {sorted(states)}, not the whole loop"
        return all(states[name].startswith(f"{want} ") for name, want in LOOP.items())

    s.wait("healthy", loop_healthy, 600)
    acked_when_healthy = s.group()["acked"]
    s.wait("three versions published", lambda: s.latest() >= 3, 900)
    s.wait("at most two versions live", lambda: s.redis.zcard(s.keys.versions) <= 2, 120)

    def nodes_live() -> bool:
        status = s.status()
        assert status["latest"] >= 3 and len(status["versions"]) <= 2, status["versions"]
        assert status["trainer"].get("step"), "no trainer heartbeat"
        nodes = status["nodes"]
        return all(n in nodes and nodes[n]["version"] >= 1 and not nodes[n]["stale"] for n in NODES)

    s.wait("both demo nodes on a live version (status --json)", nodes_live, 300)
    # The producer's batches are trained: acknowledged at each resume checkpoint.
    s.wait("acknowledged batches grow", lambda: s.group()["acked"] > acked_when_healthy, 600)

    # `docker compose restart trainer` in the middle, while it holds batches it has not
    # acknowledged: SIGTERM finishes the step, checkpoints and acknowledges; the same consumer
    # name re-reads the rest, and the run goes on from there.
    s.wait("batches delivered and not yet acknowledged", lambda: s.group()["pending"] > 0, 600)
    before, pending_before = s.group(), s.pending_ids()
    log(f"restarting the trainer with {len(pending_before)} batches unacknowledged")
    step_before, latest_before = int(s.heartbeat()["step"]), s.latest()
    started = time.monotonic()
    s.compose("restart", "trainer", timeout=300)
    s.timings["restart trainer"] = round(time.monotonic() - started, 1)
    s.wait(
        "trainer healthy again",
        lambda: without_restarts(s.states())["trainer"] == "healthy r0",
        600,
    )
    s.wait("a new version after the restart", lambda: s.latest() > latest_before, 900)
    after = s.group()
    assert after["acked"] >= before["read"], (
        "delivered before, unacknowledged after",
        before,
        after,
    )
    assert not pending_before & s.pending_ids(), "batches pending before the restart still are"
    assert int(s.heartbeat()["step"]) > step_before, "the run did not go on from its checkpoint"
    resumed = s.events("trainer", "resumed")
    assert resumed and resumed[-1]["step"] >= step_before, ("not resumed where it stopped", resumed)

    # Every batch accounted for: stop the producer, let the trainer read everything, stop it
    # (SIGTERM acknowledges what it trained). Each batch added was then trained (one step per
    # batch: micro_batches 1), dropped as stale (logged, over both trainer processes) or
    # dead-lettered; none is pending.
    s.compose("stop", "producer", timeout=120)
    s.wait("stream drained", lambda: s.group()["read"] == s.group()["added"], 600)
    s.compose("stop", "trainer", timeout=300)
    final, heartbeat = s.group(), s.heartbeat()
    states = without_restarts(s.states())
    assert states["trainer"] == states["producer"] == "exited(0) r0", states
    assert final["pending"] == 0 and final["read"] == final["added"], final
    trained = int(heartbeat["step"])
    stale = len(s.events("trainer", "dropped a stale batch"))  # one record per batch
    dead = s.redis.xlen(s.keys.dead_letters)
    assert final["added"] == trained + stale + dead, (final, heartbeat, stale, dead)
    assert dead == 0, "the demo producer's batches are valid; none should be dead-lettered"
    log(f"accounted: {final['added']} batches = {trained} trained + {stale} stale + {dead} dead")

    logs = s.logs()
    for bad in ("Traceback", '"level": "error"', '"level": "critical"'):
        assert bad not in logs, f"{bad} in the containers' logs ({STATE / 'compose-logs.txt'})"


def test_the_s3_env_file_moves_the_running_stack_to_a_bucket_a_volume_less_node_follows(
    stack: Stack,
) -> None:
    """`docker compose --env-file s3.env up -d` over the stack the test above leaves: the s3
    profile's SeaweedFS starts, the weightcast services are recreated with the bucket (the
    trainer and producer started again), the publisher uploads the live versions, and
    `s3-follower`, which mounts nothing, loads a version the publisher published after the
    switch. The teardown's `down -v` then takes s3.env too."""
    s = stack
    latest_before = s.latest()
    s.env_file = ["--env-file", "s3.env"]
    started = time.monotonic()
    s.compose("up", "-d", timeout=900)
    s.timings["up -d (s3.env)"] = round(time.monotonic() - started, 1)
    containers = s.containers()
    assert containers["s3-follower"]["Mounts"] == [], containers["s3-follower"]["Mounts"]

    def follower_on_a_bucket_version() -> bool:
        record = s.redis.hget(s.keys.nodes, "s3-follower")
        return record is not None and json.loads(record)["version"] > latest_before

    s.wait(
        "the s3 follower on a version uploaded after the switch", follower_on_a_bucket_version, 900
    )
    states = s.states()
    assert states["s3"].startswith("healthy") and states["s3-follower"].startswith("running"), (
        states
    )
    registered = {int(v) for v in s.redis.zrange(s.keys.versions, 0, -1)}
    uploaded = [e["version"] for e in s.events("publisher", "uploaded version")]
    assert uploaded and min(uploaded) > latest_before, uploaded
    assert registered & set(uploaded), (registered, uploaded)
    follower_log = s.logs("s3-follower")
    assert "s3://weights/demo/" in follower_log
    # The versions registered before the switch were on the weights volume only: the publisher
    # uploaded the live ones (a node that asked first waited for them, refusing nothing), so
    # the producer sampled from one and the trainer went on.
    stored = s.events("publisher", "uploaded a live version the store lacked")
    assert latest_before in {e["version"] for e in stored}, stored
    assert not s.events("s3-follower", "refusing version")
    assert "Traceback" not in follower_log
    publisher_log = s.logs("publisher")
    for bad in ("Traceback", '"level": "error"', '"level": "critical"'):
        assert bad not in publisher_log, bad
