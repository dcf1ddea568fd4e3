"""``python -m sglang.launch_server`` kept on versions by ``weightcast follow --sglang-url``
(a process on the server's host), through real versions: the newest one corrupt (refused,
reported, the server untouched), then one read whole, then one by delta; after each the
server's greedy tokens and log-probabilities equal, exactly, a fresh engine's from the same
weights, and the server and the registry name the version."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from weightcast.contract.nodes import NodeReport
from weightcast.local.redis_server import RedisServer

from conftest import HF_WEIGHTS, TINY
from helpers.follower import Follower
from helpers.processes import wait_for
from helpers.registry import Registry, Versions, flip_byte
from sglang_helpers import Server, greedy

NODE = "sg-serve"


@pytest.fixture(scope="module")
def served(
    tiny: Versions, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Registry]]:
    """A server started from A's directory, and a registry of its own (the newest version is
    the one each test publishes)."""
    registry = Registry(redis_server.url, "sg-serve", tmp_path_factory.mktemp("serve"))
    with Server(tiny.path("A"), tmp_path_factory.mktemp("server") / "server.log") as server:
        yield server, registry


def report(registry: Registry) -> NodeReport | None:
    client = redis.Redis.from_url(registry.redis_url)
    try:
        raw = client.hget(registry.keys.nodes, NODE)
        return NodeReport.parse(raw) if raw else None
    finally:
        client.close()


def test_follow_keeps_the_server_on_the_newest_version(
    served: tuple[Server, Registry], tiny: Versions, fresh: dict[str, Any]
) -> None:
    server, registry = served
    assert greedy(server) == fresh["A"]
    corrupt = registry.publish(TINY, tiny.states["B"], layout="hf")
    flip_byte(registry.versions[corrupt] / HF_WEIGHTS)
    env = {
        "WEIGHTCAST_REDIS_URL": registry.redis_url,
        "WEIGHTCAST_NAMESPACE": registry.namespace,
        "WEIGHTCAST_WEIGHTS_DIR": str(registry.weights_dir),
    }
    follower = Follower(env, server.url, NODE, flag="--sglang-url")
    try:
        wait_for(lambda: (r := report(registry)) and r.error, 120, "the refusal", every=0.5)
        said = report(registry)
        assert said is not None and said.version == 0
        assert said.error.startswith(f"v{corrupt} not loaded: version {corrupt} refused")
        assert greedy(server) == fresh["A"]  # untouched
        for name, via in (("B", "full"), ("C", "delta")):
            version = registry.publish(TINY, tiny.states[name], layout="hf")
            wait_for(lambda v=version: server.weight_version() == str(v), 120, f"v{version}")
            assert greedy(server) == fresh[name], name
            said = report(registry)
            assert said is not None and (said.version, said.via, said.error) == (version, via, "")
        assert registry.leases(version) == [NODE]
    finally:
        follower.process.terminate()
        follower.process.wait(30)
    assert follower.process.returncode == 0, follower.log()[-3000:]
