"""``vllm serve`` with the weightcast plugin, kept on the 0.6B versions by ``weightcast follow
--vllm-url`` reading a bucket, through the walk of ``helpers.realsize``.

The node loads each newer version it is offered (``latest``): in full, by delta, by a chain
of 3, the corrupt one refused and reported while the server keeps serving, the next one read
whole. The walk's returns to an older version are an operator's direct swaps while the node
is stopped (a node only ever moves forward); the node then carries the server on from there.
After every update the server generates what a fresh stock engine of that version generates,
and its worker's log says how it took the version."""

from __future__ import annotations

import ast
import json
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from weightcast.client.engine import REFUSED as REFUSED_REPLY
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.server import VllmServer

from helpers.processes import wait_for
from helpers.realsize import REFUSED, WALK, RealSizeVersions
from vllm_helpers import Follower, Server
from walks import FreshOutputs, fresh_of, registry_of

NODE = "realsize-serve"
LOADED = re.compile(r"weightcast: loaded (\{.*\})")


@pytest.fixture(scope="module")
def fresh_tp1(realsize: RealSizeVersions, fresh_outputs: FreshOutputs) -> dict[int, Any]:
    """Before the server starts (remembered from ``test_realsize_backend`` when it ran)."""
    return fresh_of(realsize, fresh_outputs, 1)


@pytest.fixture(scope="module")
def server(
    realsize: RealSizeVersions,
    fresh_tp1: dict[int, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    """``vllm serve`` started from version 1's HF directory; its workers read the bucket
    (the S3 client environment ``helpers.realsize.published`` set)."""
    with Server(realsize.hf_dirs[1], tmp_path_factory.mktemp("serve") / "serve.log") as server:
        yield server


def loads(server: Server) -> list[dict[str, Any]]:
    """What the server's worker logged of each update it loaded, in order."""
    return [ast.literal_eval(m[1]) for m in LOADED.finditer(server.log_path.read_text())]


def node_error(realsize: RealSizeVersions) -> str:
    deployment = realsize.deployment
    raw = deployment.client.hget(deployment.keys.nodes, NODE)
    return json.loads(raw).get("error", "") if raw else ""


def test_follow_walks_a_vllm_server_through_the_versions_from_a_bucket(
    server: Server, realsize: RealSizeVersions, fresh_tp1: dict[int, Any]
) -> None:
    deployment = realsize.deployment
    client, keys = deployment.client, deployment.keys
    latest = int(client.get(keys.latest))
    where = {**registry_of(realsize).location(NODE), "weights_root": deployment.location}
    operator = VllmServer(server.url, timeout=600)
    common = deployment.common
    env = {
        "WEIGHTCAST_REDIS_URL": deployment.redis_url,
        "WEIGHTCAST_NAMESPACE": keys.namespace,
        "WEIGHTCAST_WEIGHTS_URL": common.weights_url,
        "WEIGHTCAST_S3_ENDPOINT_URL": common.s3_endpoint_url,
        "WEIGHTCAST_S3_ADDRESSING_STYLE": common.s3_addressing_style,
    }
    client.set(keys.latest, 0)  # the node starts with nothing offered
    follower = Follower(env, server.url, NODE)
    stopped = False
    held = 0

    def wait(condition: Callable[[], object], what: str) -> None:
        def alive_and() -> object:
            assert follower.process.poll() is None, follower.log()[-4000:]
            return condition()

        wait_for(alive_and, 600, what)

    try:
        for step in WALK:
            before = len(loads(server))
            if step.via != REFUSED and step.version < held:
                # Back to an older version: the node is stopped (idle: its last step is
                # done) while an operator swaps the server.
                follower.process.send_signal(signal.SIGSTOP)
                stopped = True
                swap(operator, step.version, where)
            else:
                client.set(keys.latest, step.version)
                if stopped:
                    follower.process.send_signal(signal.SIGCONT)
                    stopped = False
                if step.via == REFUSED:
                    wait(
                        lambda v=step.version: f"v{v} not loaded" in node_error(realsize),
                        f"the node to report v{step.version} refused",
                    )
                    assert REFUSED_REPLY in node_error(realsize), node_error(realsize)
                else:
                    wait(lambda v=step.version: server.served() == v, f"v{step.version}")
            if step.via != REFUSED:
                held = step.version
                (taken,) = loads(server)[before:]
                assert (taken["version"], taken["via"]) == (held, step.via), (step, taken)
            else:
                assert loads(server)[before:] == [], step
            assert server.served() == held, step
            assert not server.call("GET", "/is_paused")["is_paused"], step
            assert server.greedy() == fresh_tp1[held], step
    except BaseException:
        print(follower.log()[-8000:])  # pytest shows it with the failure
        raise
    finally:
        if stopped:
            follower.process.send_signal(signal.SIGCONT)
        follower.process.terminate()
        code = follower.process.wait(60)
        client.set(keys.latest, latest)
    assert code == 0, follower.log()[-4000:]
    assert "vllm serves version" in follower.log()
    assert all(client.zcard(keys.leases(s.version)) == 0 for s in WALK)
