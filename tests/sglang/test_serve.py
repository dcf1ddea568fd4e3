"""``python -m sglang.launch_server`` kept on versions by ``weightcast follow --sglang-url``
(a process on the server's host), through real versions: the newest one corrupt (refused,
reported, the server untouched), then one read whole, then one by delta, then one whose node
is SIGKILLed in the middle of the update (the next node ends the session it left open and
loads the version), then a restart of the server (brought back to the newest version); after
each the server's greedy tokens and log-probabilities equal, exactly, a fresh engine's from
the same weights, and the server and the registry name the version. Last, a node started
beside a server already on the newest version leases that version and loads nothing."""

from __future__ import annotations

import re
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

        # SIGKILL in the middle of an update: stopped the moment it hands the tensors over,
        # after SGLang's weight-update session was opened.
        follower.stop_at = re.compile(r"sglang request .*route=/update_weights_from_tensor")
        newest = registry.publish(TINY, tiny.states["B"], layout="hf")
        assert follower.stopped.wait(120), follower.log()[-3000:]
        follower.process.kill()
        follower.process.wait(30)
    finally:
        follower.process.kill()
        follower.process.wait(30)

    # The next node ends the session left open (SGLang opens no other) and loads the newest.
    follower = Follower(env, server.url, NODE, flag="--sglang-url")
    try:
        wait_for(lambda: server.weight_version() == str(newest), 120, "the next node's load")
        assert "ended the weight-update session a stopped node left open" in follower.log()
        assert greedy(server) == fresh["B"]
        wait_for(lambda: registry.leases(newest) == [NODE], 30, "the new node's lease")

        # A restarted server (A's weights and version again) is brought back to the newest.
        server.stop()
        server.start()
        server.wait_ready()
        wait_for(lambda: server.weight_version() == str(newest), 300, "the restarted server")
        assert greedy(server) == fresh["B"] != fresh["A"]
        assert "sglang server unavailable; waiting for it" in follower.log()
    finally:
        follower.process.terminate()
        assert follower.process.wait(60) == 0, follower.log()[-3000:]
    assert registry.leases(newest) == []  # a stopped node lets go of its lease

    # A node started beside a server already on the newest version leases it, loading nothing.
    follower = Follower(env, server.url, NODE, flag="--sglang-url")
    try:
        wait_for(lambda: registry.leases(newest) == [NODE], 60, "the served version's lease")
        assert "sglang serves version" not in follower.log()
    finally:
        follower.process.terminate()
        assert follower.process.wait(60) == 0, follower.log()[-3000:]
