"""``weightcast follow``, ``produce`` and ``status --watch`` as real processes against bad luck:
a series of broken versions, a Redis restarted mid-run (AOF on) and a Redis that is full."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.net import free_port

from helpers.files import REPO, OpenWatch
from helpers.processes import OutputLines, healthz, run_weightcast, stop, wait_for, weightcast
from helpers.versions import Deployment, copy_version, redigest, register_version


def start(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], OutputLines]:
    process = subprocess.Popen(
        weightcast(*args),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, OutputLines(process)


def bad_header(directory: Path) -> None:
    path = directory / "model.vllm-fused"
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])
    redigest(directory, block_bytes=4096)


def flip_a_byte(directory: Path) -> None:
    path = directory / "model.vllm-fused"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(directory: Path, change: Callable[[dict], object]) -> None:
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    change(manifest)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def weights_blocks(manifest: dict) -> dict:
    """The block digests of ``model.vllm-fused``, listed first (``config.json`` is last)."""
    assert manifest["files"][0]["name"] == "model.vllm-fused"
    return manifest["files"][0]["blocks"]


def link_weights_out(directory: Path) -> None:
    outside = directory.parent.parent / "outside"
    os.unlink(directory / "model.vllm-fused")
    os.symlink(outside / "model.vllm-fused", directory / "model.vllm-fused")


BROKEN = [
    # (what is broken, how, what the refusal must say)
    ("a flipped byte", flip_a_byte, r"model\.vllm-fused: bytes \d+\.\.\d+ do not match"),
    ("safetensors header", bad_header, r"model\.vllm-fused: safetensors header claims"),
    (
        "manifest not JSON",
        lambda d: (d / MANIFEST_NAME).write_text("{nope"),
        r"manifest\.json: not a valid manifest",
    ),
    (
        "config not JSON",
        lambda d: ((d / "config.json").write_text("{nope"), redigest(d)),
        r"config\.json is not JSON",
    ),
    (
        "manifest without tensors",
        lambda d: edit_manifest(d, lambda m: m.pop("tensors")),
        r"manifest\.json: not a valid manifest \(lacks 'tensors'\)",
    ),
    ("registry hash without path", None, r"registry entry of version \d+ has no 'path'"),
    (
        "tensor file outside",
        lambda d: edit_manifest(
            d, lambda m: [t.update(file="../../outside/model.vllm-fused") for t in m["tensors"]]
        ),
        r"names the file '\.\./\.\./outside/model\.vllm-fused': not a plain file name",
    ),
    ("weights file linked out", link_weights_out, r"model\.vllm-fused: a symbolic link"),
    # What once crashed follow with a TypeError: each field's type is checked at the parse.
    (
        "digest algorithm as a list",
        lambda d: edit_manifest(d, lambda m: weights_blocks(m).update(algorithm=["xxh3-128"])),
        r"files\[0\]\.blocks\.algorithm is \['xxh3-128'\], not a string",
    ),
    (
        "float block_bytes",
        lambda d: edit_manifest(d, lambda m: weights_blocks(m).update(block_bytes=65536.5)),
        r"files\[0\]\.blocks\.block_bytes is 65536\.5, not an integer",
    ),
    (
        "float block lengths that sum to the size",
        lambda d: edit_manifest(
            d, lambda m: weights_blocks(m).update(lengths=[float(m["files"][0]["bytes"])])
        ),
        r"files\[0\]\.blocks\.lengths is \[\d+\.0\], not a list of integers",
    ),
    (
        "float file bytes",
        lambda d: edit_manifest(
            d, lambda m: m["files"][0].update(bytes=m["files"][0]["bytes"] + 0.0)
        ),
        r"files\[0\]\.bytes is \d+\.0, not an integer",
    ),
    (
        "tensor name as a list",
        lambda d: edit_manifest(
            d, lambda m: m["tensors"][0].update(name=[m["tensors"][0]["name"]])
        ),
        r"tensors\[0\]\.name is \['.*'\], not a string",
    ),
]


def test_follow_refuses_each_broken_version_and_loads_the_next_good_one(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer, cli_env: dict
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url)
    deployment.publish()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.vllm-fused").write_bytes(
        (tmp_path / "weights/v1/model.vllm-fused").read_bytes()
    )
    watch = OpenWatch(outside)
    final = 1 + len(BROKEN) + 1
    follower, output = start(
        cli_env,
        "follow",
        "--node-id",
        "n1",
        "--poll-seconds",
        "0.2",
        "--until-version",
        str(final),
    )
    output.wait_for(r"loaded version .*version=1\b")
    for what, damage, message in BROKEN:
        number, directory = copy_version(deployment, 1)
        if damage is not None:
            damage(directory)
        register_version(deployment, number, like=1, drop=() if damage else ("path",))
        line = output.wait_for(rf"refusing version .*version={number}\b")
        assert re.search(message, line), (what, line)
        assert json.loads(client.hget(keys.nodes, "n1"))["version"] == 1  # still serving v1
    number, _ = copy_version(deployment, 1)
    register_version(deployment, number, like=1)
    assert number == final
    assert follower.wait(timeout=120) == 0, output.text()
    assert json.loads(client.hget(keys.nodes, "n1"))["version"] == final
    assert client.zcard(keys.leases(final)) == 0  # released on exit
    assert "Traceback" not in output.text()
    assert watch.touched() == [], "follow opened a file outside the weights root"
    watch.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (AOF on), which the test stops and restarts."""
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    yield server
    server.stop()


def env_for(server: RedisServer, cli_env: dict[str, str]) -> dict[str, str]:
    """``cli_env`` on this test's own Redis, riding out outages for up to 3 minutes."""
    return {**cli_env, "WEIGHTCAST_REDIS_URL": server.url, "WEIGHTCAST_REDIS_RETRY_SECONDS": "180"}


def deliver_until_exit(client: redis.Redis, keys: Keys, producer: subprocess.Popen[str]) -> None:
    """Deliver and acknowledge batches as a trainer would, so that a producer held back by
    ``--max-pending`` goes on, until it exits."""

    def deliver() -> bool:
        for _, entries in client.xreadgroup(TRAINER_GROUP, "drain", {keys.batches: ">"}) or []:
            client.xack(keys.batches, TRAINER_GROUP, *(entry_id for entry_id, _ in entries))
        return producer.poll() is not None

    wait_for(deliver, 180, "produce to push every batch")


def test_follow_produce_and_status_ride_out_a_redis_restart(
    own_redis: RedisServer, keys: Keys, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    deployment = Deployment(client, keys, tmp_path, own_redis.url)
    env = env_for(own_redis, cli_env)
    port = free_port()
    follower, follow_out = start(
        env, "follow", "--node-id", "n1", "--poll-seconds", "0.2", "--metrics-port", str(port)
    )
    # Nothing delivers batches until Redis is back: produce is mid-run, held back after 4.
    producer, produce_out = start(env, "produce", "--count", "12", "--max-pending", "4")
    watcher, watch_out = start(env, "status", "--watch", "0.2", "--json")
    deployment.publish()
    follow_out.wait_for(r"loaded version .*version=1\b")
    produce_out.wait_for(r"pushed batch index=4\b")
    assert wait_for(lambda: healthz(port) == 200, 60, "follow's /healthz")

    own_redis.stop()  # SIGTERM: the AOF is flushed, as in an orderly restart
    assert wait_for(lambda: healthz(port) == 503, 60, "/healthz 503 while Redis is down")
    follow_out.wait_for("Redis unreachable; retrying")
    produce_out.wait_for("Redis unreachable; retrying")
    watch_out.wait_for("Redis unreachable; retrying")

    own_redis.start()
    assert wait_for(lambda: healthz(port) == 200, 90, "/healthz 200 once Redis is back")
    deployment.publish()
    follow_out.wait_for(r"loaded version .*version=2\b", timeout=90)
    deliver_until_exit(client, keys, producer)
    assert producer.wait() == 0, produce_out.text()
    entries = client.xrange(keys.batches)
    indices = [json.loads(fields[b"meta"])["index"] for _, fields in entries]
    assert sorted(indices) == list(range(1, 13))  # every batch once: none lost, none doubled
    watch_out.wait_for(r'"latest": 2\b', timeout=60)
    assert json.loads(client.hget(keys.nodes, "n1"))["version"] == 2
    assert stop(follower) == 0 and stop(watcher, signal.SIGINT) == 0
    for output in (follow_out, produce_out, watch_out):
        assert "Traceback" not in output.text(), output.text()
    client.close()


def test_a_full_redis_stops_produce_with_one_line_and_holds_back_rollouts(
    own_redis: RedisServer, keys: Keys, cli_env: dict[str, str]
) -> None:
    client = redis.Redis.from_url(own_redis.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")  # anything written from now on is refused
    env = env_for(own_redis, cli_env)
    produced = run_weightcast(env, "produce", "--count", "1", timeout=120)
    assert produced.returncode == 1
    (line,) = produced.stderr.strip().splitlines()[-1:]
    assert line.startswith("weightcast produce: Redis is full and refuses writes while pushing")
    assert "maxmemory" in line and "Traceback" not in produced.stderr

    client.config_set("maxmemory", "0")
    port = free_port()
    node, output = start(
        env,
        "follow",
        "--rollout",
        "--max-pending",
        "0",
        "--poll-seconds",
        "0.2",
        "--metrics-port",
        str(port),
    )
    output.wait_for("pushed rollout batch")
    client.config_set("maxmemory", "1")
    output.wait_for("Redis is full; retrying")
    assert wait_for(lambda: healthz(port) == 503, 60, "/healthz 503 while Redis is full")
    client.config_set("maxmemory", "0")
    output.wait_for("Redis is back")
    output.wait_for("pushed rollout batch")
    assert wait_for(lambda: healthz(port) == 200, 60, "/healthz 200 once Redis has room")
    assert stop(node) == 0
    pushed = output.text().count("pushed rollout batch")
    assert client.xlen(keys.batches) == pushed  # the held batch went in once, none lost
    assert "Traceback" not in output.text()
    client.close()
