"""``vllm serve`` on CPU kept on the newest version by ``weightcast follow --vllm-url``.

The server runs the ``weightcast`` backend (``VLLM_SERVER_DEV_MODE=1`` for the weight-sync
routes); the node is the real CLI. Each version the publisher writes is served, exactly as a
fresh engine serves it; ``/weight_info`` names it; the node holds a lease on the version
served and nothing else; a version the engine refuses is reported and skipped; a node killed
with SIGKILL in the middle of an update leaves a whole version behind, and the next node
finishes the job; a restarted server is brought back to the newest version.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from conftest import Versions
from helpers.files import REPO
from helpers.models import checkpoint_tensors, save_pretrained_qwen3
from helpers.processes import wait_for
from vllm_helpers import TINY, Follower, Registry, Server

NODE = "serve-node"


def start_follower(registry: Registry, url: str) -> Follower:
    """``weightcast follow --vllm-url`` of ``registry``'s versions (its weights directory)."""
    env = {
        "WEIGHTCAST_REDIS_URL": registry.redis_url,
        "WEIGHTCAST_NAMESPACE": registry.namespace,
        "WEIGHTCAST_WEIGHTS_DIR": str(registry.weights_dir),
    }
    return Follower(env, url, NODE)


def node_record(registry: Registry) -> dict[str, Any]:
    raw = redis.Redis.from_url(registry.redis_url).hget(registry.keys.nodes, NODE)
    return json.loads(raw) if raw else {}


@pytest.fixture(scope="module")
def server(tiny: Versions, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``vllm serve`` started from version A's HF layout, with the weightcast backend."""
    with Server(tiny.hf_dir("A"), tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


def test_follow_keeps_a_vllm_server_on_the_newest_version(
    server: Server,
    tiny: Versions,
    fresh_outputs: Any,
    redis_server: Any,
    tmp_path: Path,
) -> None:
    by_dir = fresh_outputs(1, [tiny.hf_dir(name) for name in "ABC"])
    fresh = {name: by_dir[tiny.hf_dir(name)] for name in "ABC"}
    assert server.greedy() == fresh["A"] and server.served() == 0
    registry = Registry(redis_server.url, "serve", tmp_path)
    first = registry.publish(TINY, tiny.states["B"])
    follower = start_follower(registry, server.url)
    try:
        wait_for(lambda: server.served() == first, 300, "the node to load the first version")
        assert server.greedy() == fresh["B"]
        wait_for(lambda: registry.leases(first) == [NODE], 30, "only the node's lease")
        assert node_record(registry)["version"] == first

        # Each new version is served; the node's lease moves with it.
        second = registry.publish(TINY, tiny.states["C"], layout="both")
        wait_for(lambda: server.served() == second, 120, "the second version")
        assert server.greedy() == fresh["C"]
        wait_for(lambda: registry.leases(first) == [], 30, "the first version's lease to go")
        assert registry.leases(second) == [NODE]

        # A version the engine refuses: reported, skipped, the server serves what it did.
        refused = registry.publish(TINY, tiny.states["A"], tp=2)
        wait_for(lambda: "error" in node_record(registry), 120, "the node to report the error")
        record = node_record(registry)
        assert record["version"] == second
        assert f"v{refused} not loaded" in record["error"]
        assert "is fused for tp=2; this engine runs tp=1" in record["error"]
        assert server.served() == second and not server.call("GET", "/is_paused")["is_paused"]
        assert server.greedy() == fresh["C"]
        where = ["--redis-url", registry.redis_url, "--namespace", registry.namespace]
        status = subprocess.run(
            [sys.executable, "-m", "weightcast", "status", *where],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert f"{NODE}: v{second}" in status.stdout and "ERROR: " in status.stdout

        # The node goes on following: the next good version loads, and clears the error.
        third = registry.publish(TINY, tiny.states["B"])
        wait_for(lambda: server.served() == third, 120, "the version after the refused one")
        assert server.greedy() == fresh["B"]
        wait_for(lambda: "error" not in node_record(registry), 30, "the error to clear")

        # SIGKILL in the middle of an update: stopped the moment it asks for the update.
        follower.stop_at = re.compile(r"vllm request .*route=/update_weights")
        fourth = registry.publish(TINY, tiny.states["A"])
        assert follower.stopped.wait(120), follower.log()
        follower.process.kill()
        follower.process.wait(30)
        assert server.call("GET", "/is_paused")["is_paused"]  # it died between pause and resume
    finally:
        follower.process.kill()
        follower.process.wait(30)

    # The next node undoes the half-done update (session, pause) and serves the newest.
    follower = start_follower(registry, server.url)
    try:
        wait_for(lambda: server.served() == fourth, 120, "a new node to finish the update")
        assert not server.call("GET", "/is_paused")["is_paused"]
        assert server.greedy() == fresh["A"]
        wait_for(lambda: registry.leases(fourth) == [NODE], 30, "the new node's lease")
        assert all(registry.leases(v) == [] for v in (first, second, refused, third))

        # A restarted server (its weights and version are the start's again; the workers
        # know nothing of Redis) is initialised again and brought back to the newest version.
        server.stop()
        server.start()
        server.wait_ready()
        wait_for(lambda: server.served() == fourth, 300, "the restarted server to be brought back")
        assert server.greedy() == fresh["A"]
        assert "vllm server unavailable; waiting for it" in follower.log()
    finally:
        follower.process.terminate()
        assert follower.process.wait(60) == 0, follower.log()
    assert registry.leases(fourth) == []  # a stopped node lets go of its lease
    assert "vllm serves version" in follower.log()


def test_vllm_serve_of_a_users_checkpoint_is_moved_on_to_each_fused_version(
    fresh_outputs: Any, redis_server: Any, tmp_path: Path
) -> None:
    """``vllm serve DIR`` on a directory ``save_pretrained`` wrote (a stock Qwen3ForCausalLM
    config), driven by ``follow --vllm-url``: each fused version of the same model, as the
    trainer moves it on, is served exactly as a fresh engine serves that model."""
    start = save_pretrained_qwen3(tmp_path / "start", "untied-odd", torch.bfloat16)
    trained = [
        save_pretrained_qwen3(tmp_path / f"trained-{seed}", "untied-odd", torch.bfloat16, seed=seed)
        for seed in (1, 2)
    ]
    fresh = fresh_outputs(1, [start, *trained])
    assert len({json.dumps(fresh[d]) for d in (start, *trained)}) == 3  # they differ where it shows
    config = json.loads((start / "config.json").read_text())
    registry = Registry(redis_server.url, "serve-start", tmp_path / "registry")
    server = Server(start, tmp_path / "serve.log")
    server.start()
    follower = None
    try:
        server.wait_ready()
        assert server.greedy() == fresh[start]
        follower = start_follower(registry, server.url)
        for directory in trained:
            version = registry.publish(config, checkpoint_tensors(directory))
            wait_for(lambda v=version: server.served() == v, 300, f"v{version} served")
            assert server.greedy() == fresh[directory], directory.name
            assert node_record(registry)["version"] == version
    finally:
        if follower is not None:
            follower.process.terminate()
            follower.process.wait(timeout=60)
        server.stop()
