"""What a node holds between updates, over many updates from a real bucket: one Redis
connection, one store, one base, and no growth. A vLLM rank's reader (:class:`RankReader`,
kept by the backend for the engine's life) and a plain :class:`Node` each go through full
reads, single deltas, chains and returns to older versions, of a model whose embedding spans
several ranged GETs (the store's thread pool reads it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.node import Node
from weightcast.client.reader import VersionReader
from weightcast.client.vllm.protocol import ResolvedLocation
from weightcast.client.vllm.staging import RankReader
from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server
from weightcast.runtime.settings import load_config
from weightcast.store.s3 import PART_BYTES, S3Store

from helpers.models import drift, hf_state, shape_of
from helpers.processes import process_resources
from helpers.s3 import store_settings
from helpers.versions import Deployment

pytestmark = pytest.mark.usefixtures("s3_env")

WIDE = dataclasses.replace(shape_of(4, 2, 64, hidden=512, inter=1024), vocab_size=32768)
"""A 32 MiB embedding: each full read of it takes two ranged GETs at once."""
VERSIONS = 4


@dataclasses.dataclass
class WideVersions:
    deployment: Deployment
    local: VersionReader
    """The publisher's own directory: what every read must equal, bitwise."""


@pytest.fixture
def published(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: S3Server,
    s3_bucket: str,
) -> Iterator[WideVersions]:
    """Versions 1-4 of WIDE in a bucket, each a small drift of the one before, each with its
    delta (``delta_behind = "wait"``: kept however slow the encoding), all four live."""
    settings = store_settings(s3_server, s3_bucket, retry_seconds=5)
    deployment = Deployment(
        client,
        keys,
        tmp_path,
        redis_server.url,
        shape=WIDE,
        store=settings,
        keep=VERSIONS,
        delta_behind="wait",
    )
    assert 2 * WIDE.vocab_size * WIDE.hidden_size > PART_BYTES
    state = hf_state(WIDE, torch.bfloat16)
    for step in range(1, VERSIONS + 1):
        drift(state, step)
        assert deployment.publish(state) == step
    assert all(deployment.reader().info(v).delta_from == v - 1 for v in range(2, VERSIONS + 1))
    local = VersionReader(tmp_path / "weights")
    yield WideVersions(deployment, local)
    local.close()
    deployment.publisher.close()


ROUTE = [1, 2, 3, 1, 4, 2, 3, 4, 1, 4]
"""Full, delta, delta, back to an older version (full), a chain of 3, back (full), delta,
delta, back (full), a chain of 3: each kind of update more than once."""
VIA = ["full", "delta", "delta", "full", "chain", "full", "delta", "delta", "full", "chain"]


def test_a_vllm_ranks_reader_keeps_one_store_and_base_across_updates(
    published: WideVersions, redis_server: RedisServer
) -> None:
    """The backend's reader for one rank, as vLLM keeps it: ten updates in a row through the
    same store (a bucket's client and thread pool, never closed by an update), each staged
    part bitwise the published version's; closing it releases its connection and pool.
    (Before, each update closed the store the next one read through: ``cannot schedule new
    futures after shutdown`` at the first full read after an update.)"""
    deployment = published.deployment
    source = ResolvedLocation(
        redis_url=redis_server.url,
        namespace=deployment.keys.namespace,
        weights_root=deployment.location,
        node_id="rank-reader",
        verified_dir=deployment.root / "verified",
    )
    config = load_config(env={}, overrides={"store_retry_seconds": 5})
    reader = RankReader(source, rank=0, keep_base=True, config=config)
    store = reader.client.reader.store
    assert isinstance(store, S3Store)
    for version, via in zip(ROUTE, VIA, strict=True):
        staged = reader.stage(version, tp=1, engine_shape=WIDE)
        assert (staged.version, staged.via) == (version, via), reader.client.reader.stats.reason
        info = reader.client.info(version)
        expected = published.local.rank_tensors(info, 0, 1)
        assert {p.name for p in staged.parts} == set(expected)
        assert all(torch.equal(p.tensor, expected[p.name]) for p in staged.parts), version
        assert reader.client.reader.store is store
    assert all(deployment.client.zcard(deployment.keys.leases(v)) == 0 for v in ROUTE)
    reader.close()
    assert store.pool._shutdown


def resources(client: redis.Redis) -> dict[str, int]:
    """This process's threads, files, sockets and memory, and the Redis server's clients."""
    return {**process_resources(), "redis_clients": len(client.client_list())}


def test_a_node_following_50_updates_from_a_bucket_holds_nothing_more_at_the_end(
    published: WideVersions,
) -> None:
    """A keep-base node (as ``weightcast follow`` runs it) loads 50 updates over the route:
    after 10 to warm up, its threads, open files and Redis connections are what they were,
    its sockets within its store's connection pool, and its memory grew by less than one
    version (a version, a store or a connection left behind per update would show 40 times
    over)."""
    deployment = published.deployment
    weights = deployment.reader(node_id="follower")
    weights.reader.keep_base = True
    node = Node(weights, report_every=60)
    observer = redis.Redis.from_url(deployment.redis_url)
    seen: dict[str, int] = {}
    version_bytes = sum(t.nbytes for t in hf_state(WIDE, torch.bfloat16).values())
    try:
        for update in range(50):
            version = ROUTE[update % len(ROUTE)]
            node.seen = 0  # load it even when it is older than the last
            loaded = node.load(version)
            assert loaded is not None and node.current == version
            if update in (0, 9, 49):
                expected = published.local.load(loaded.info)
                assert all(torch.equal(loaded.tensors[k], expected[k]) for k in expected)
            del loaded
            if update == 9:
                seen = resources(observer)
        end = resources(observer)
        for kind in ("threads", "files", "redis_clients"):
            assert end[kind] <= seen[kind], (kind, seen, end)
        # The bucket client's connection pool opens sockets as its GETs first overlap, up to
        # its size.
        store = weights.reader.store
        assert isinstance(store, S3Store)
        assert end["sockets"] <= seen["sockets"] + store.concurrency + 4, (seen, end)
        assert end["rss"] - seen["rss"] < version_bytes, (seen, end)
    finally:
        node.close()
        weights.close()
        observer.close()
