"""Readers against a real redis-server and real version directories: leases, checks, waits."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.weights import AsyncWeightsClient, VersionGone, WeightsError
from weightcast.contract.errors import LayoutError
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file
from weightcast.contract.manifest import (
    verify_files,
)
from weightcast.local.redis_server import RedisServer

from helpers.files import REPO
from helpers.models import SMALL_GQA, hf_state
from helpers.processes import wait_for
from helpers.redis_state import redis_ms, subscribers
from helpers.versions import Deployment, split_per_rank
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)

SHAPE = SMALL_GQA


@pytest.fixture
def deployment(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> Deployment:
    return Deployment(client, keys, tmp_path, redis_server.url)


def test_a_leased_version_outlives_newer_versions_until_released(deployment: Deployment) -> None:
    deployment.publish()
    deployment.publish()
    reader = deployment.reader(lease_seconds=2.0)  # renewed by the client while held
    leases = deployment.keys.leases(1)
    with reader.lease(1) as info:
        first_expiry = deployment.client.zscore(leases, reader.node_id)
        for _ in range(3):
            deployment.publish()
        wait_for(lambda: redis_ms(deployment.client) > first_expiry, 60, "the first expiry to pass")
        # Past the lease's first expiry and three newer versions later, v1 is still whole:
        # only because the client renewed the lease.
        deployment.evictor.run()
        assert deployment.client.zscore(leases, reader.node_id) > first_expiry
        assert 1 in deployment.registry.live_versions()
        manifest = reader.verify(info)
        assert len(reader.load(info)) == len(manifest.tensors)
    assert deployment.registry.live_versions() == [1, 4, 5]
    deployment.evictor.run()
    assert deployment.registry.live_versions() == [4, 5]
    assert not (deployment.root / "weights" / "v1").exists()
    # v2 and v3 stay delta-only (publisher.delta_window): their manifest, config and delta.
    weights = deployment.root / "weights"
    assert sorted(p.name for p in weights.iterdir()) == ["v2", "v3", "v4", "v5"]
    assert sorted(p.name for p in (weights / "v3").iterdir()) == [
        "config.json",
        "delta-from-v2.xor-sparse",
        "manifest.json",
    ]


def test_an_evicted_version_cannot_be_leased(deployment: Deployment) -> None:
    for _ in range(3):
        deployment.publish()
    with pytest.raises(VersionGone), deployment.reader().lease(1):
        pass


def test_the_lease_of_a_killed_reader_expires(
    deployment: Deployment, redis_server, keys: Keys
) -> None:
    holder = subprocess.Popen(  # started first: it imports while versions are published
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from weightcast.client.weights import WeightsClient
        client = WeightsClient(
            {redis_server.url!r}, {str(deployment.root / "weights")!r},
            namespace={keys.namespace!r}, node_id="doomed-node", lease_seconds=2,
        )
        sys.stdin.readline()
        with client.lease(1):
            print("leased", flush=True)
            time.sleep(600)
    """),
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    deployment.publish()
    deployment.publish()
    holder.stdin.write("lease v1\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "leased"
    deployment.publish()  # v1 is no longer among the newest two: only the lease keeps it
    assert 1 in deployment.registry.live_versions()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    expiry = deployment.client.zscore(keys.leases(1), "doomed-node")  # renewed no more
    passes: list[tuple[int, bool]] = []  # (Redis's clock after an eviction pass, v1 kept)

    def evict() -> bool:
        deployment.evictor.run()
        passes.append((redis_ms(deployment.client), 1 in deployment.registry.live_versions()))
        return not passes[-1][1]

    wait_for(evict, 60, "the dead reader's lease to expire")
    assert all(kept for clock, kept in passes if clock < expiry), "evicted while leased"
    assert not (deployment.root / "weights" / "v1").exists()


def test_a_path_outside_the_weights_root_is_refused(deployment: Deployment, tmp_path: Path) -> None:
    deployment.publish()
    deployment.client.hset(deployment.keys.version(1), "path", str(tmp_path / "elsewhere"))
    reader = deployment.reader()
    with reader.lease(1) as info, pytest.raises(WeightsError, match="outside the weights root"):
        reader.verify(info)


def test_a_corrupted_file_fails_verification_naming_the_file(deployment: Deployment) -> None:
    deployment.publish()
    weights = deployment.root / "weights" / "v1" / FUSED_WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    reader = deployment.reader()
    with (
        reader.lease(1) as info,
        pytest.raises(
            WeightsError, match=r"model\.vllm-fused: bytes 0\.\.\d+ do not match the manifest"
        ),
    ):
        reader.verify(info)


def test_wait_for_newer_wakes_on_the_event_and_survives_a_lost_one(
    deployment: Deployment,
) -> None:
    reader = deployment.reader()
    client, events = deployment.client, deployment.keys.events
    assert reader.wait_for_newer(0, timeout=0.3, poll=0.1) is None

    def once_it_listens(change: Callable[[], object]) -> threading.Thread:
        """Run ``change`` in a thread once the reader has subscribed to the events."""

        def run() -> None:
            wait_for(lambda: subscribers(client, events) > 0, 60, "the reader to subscribe")
            change()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    # It polls far less often than it may wait: only the pub/sub event can wake it.
    publisher = once_it_listens(deployment.publish)
    assert reader.wait_for_newer(0, timeout=120, poll=3600) == 1
    publisher.join()
    # A version whose event never arrives (latest set without PUBLISH) is found by polling.
    silent = once_it_listens(lambda: client.set(deployment.keys.latest, 2))
    assert reader.wait_for_newer(1, timeout=120, poll=0.2) == 2
    silent.join()


def test_a_published_version_verifies_and_loads(deployment: Deployment) -> None:
    deployment.publish()
    reader = deployment.reader()
    assert reader.latest() == 1
    with reader.lease(1) as info:
        manifest = reader.verify(info)
        verify_files(reader.reader.path(info), manifest)
        tensors = reader.load(info)
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    reader.report_loaded(1)
    assert b"node-a" in deployment.client.hkeys(deployment.keys.nodes)
    assert deployment.client.zcard(deployment.keys.leases(1)) == 0  # released on exit


def vllm_rank(name: str, state: dict[str, torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """What vLLM's own loaders put on ``rank`` for the fused or plain tensor ``name``."""
    if ".qkv_proj." in name:
        q, k, v = (state[name.replace("qkv_proj", f"{x}_proj")] for x in "qkv")
        return qkv_parallel_rank(
            q, k, v, SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim, tp, rank
        )
    if ".gate_up_proj." in name:
        gate, up = (state[name.replace("gate_up_proj", f"{x}_proj")] for x in ("gate", "up"))
        return merged_column_parallel_rank(gate, up, tp, rank)
    if name == "model.embed_tokens.weight":
        rows = vocab_parallel_rank(state[name], tp, rank)
        start = min(rank * rows.shape[0], SHAPE.vocab_size)
        return rows[: min(SHAPE.vocab_size - start, rows.shape[0])]  # padding is not published
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return row_parallel_rank(state[name], tp, rank)
    return state[name]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_tensors_are_vllms_rank_tensors_from_fused_and_per_rank_files(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer, tp: int
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=tp)
    fused = deployment.publish()
    per_rank = split_per_rank(deployment, fused)
    state = hf_state(SHAPE, torch.bfloat16)  # what write_snapshot published
    reader = deployment.reader()
    for rank in range(tp):
        from_fused = reader.rank_tensors(fused, rank, tp)
        from_split = reader.rank_tensors(per_rank, rank, tp)
        assert from_fused.keys() == from_split.keys() and len(from_fused) > 10
        for name, tensor in from_fused.items():
            expected = vllm_rank(name, state, tp, rank)
            assert torch.equal(tensor, expected), (name, rank)
            assert torch.equal(from_split[name], expected), (name, rank)
    if tp > 1:
        with pytest.raises(LayoutError, match=f"fused for tp={tp} cannot serve tp=1"):
            reader.rank_tensors(fused, 0, 1)
        with pytest.raises(LayoutError, match=f"per-rank files for tp={tp}"):
            reader.rank_tensors(per_rank, 0, 2 * tp)


def test_reads_land_in_host_memory_under_a_default_device_context(
    deployment: Deployment,
) -> None:
    """Under ``torch.device("cuda")`` (which some vLLM versions hold around a weight update;
    the meta device stands in for it here) a read must still target host memory: preadv
    writes to the tensors' addresses."""
    version = deployment.publish()
    reader = deployment.reader()
    expected = reader.rank_tensors(version, 0, 1)
    whole = reader.load(version)
    with torch.device("meta"):
        got = reader.rank_tensors(version, 0, 1)
        got_whole = reader.load(version)
    for want, have in ((expected, got), (whole, got_whole)):
        assert have.keys() == want.keys() and len(have) > 10
        assert {t.device.type for t in have.values()} == {"cpu"}
        assert all(torch.equal(have[name], tensor) for name, tensor in want.items())


def test_a_rank_reads_and_verifies_only_its_own_per_rank_file(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=2)
    per_rank = split_per_rank(deployment, deployment.publish())
    target = tmp_path / "weights" / "v1-per-rank" / fused_rank_file(1, 2)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    reader = deployment.reader()
    assert len(reader.rank_tensors(per_rank, 0, 2)) > 10  # rank 0 never touches it
    with pytest.raises(
        WeightsError, match=r"model-rank-01-of-02\.vllm-fused: bytes .* do not match"
    ):
        reader.rank_tensors(per_rank, 1, 2)
    with pytest.raises(WeightsError, match="per-rank files"):
        reader.load(per_rank)


def test_the_async_client_leases_waits_and_reads_without_blocking_the_loop(
    deployment: Deployment,
) -> None:
    """The asyncio client against the real publisher: its lease task keeps the oldest version
    through evictions, a wait is woken by the event (and cancellable), and what it reads
    equals what the thread-based client reads."""
    reader = AsyncWeightsClient(
        deployment.redis_url,
        deployment.root / "weights",
        namespace=deployment.keys.namespace,
        node_id="node-async",
        lease_seconds=2.0,
    )

    async def scenario() -> None:
        assert await reader.latest() == 0
        events = deployment.keys.events
        waiting = asyncio.create_task(reader.wait_for_newer(0, timeout=120, poll=3600))
        await asyncio.to_thread(
            wait_for, lambda: subscribers(deployment.client, events) > 0, 60, "the subscription"
        )
        await asyncio.to_thread(deployment.publish)  # only the pub/sub event can wake it
        assert await waiting == 1
        await asyncio.to_thread(deployment.publish)

        async with reader.lease(1) as info:
            first_expiry = deployment.client.zscore(deployment.keys.leases(1), "node-async")
            for _ in range(3):
                await asyncio.to_thread(deployment.publish)
            await asyncio.to_thread(
                wait_for, lambda: redis_ms(deployment.client) > first_expiry, 60, "the expiry"
            )
            deployment.evictor.run()  # past the first expiry: kept because it was renewed
            assert 1 in deployment.registry.live_versions()
            manifest = await reader.verify(info)
            tensors = await reader.load(info)
            assert (await reader.config(info))["num_attention_heads"] == SHAPE.num_heads
            rank_tensors = await reader.rank_tensors(1, 0, 1)
        assert deployment.client.zcard(deployment.keys.leases(1)) == 0  # released on exit
        deployment.evictor.run()
        assert deployment.registry.live_versions() == [4, 5]
        with pytest.raises(VersionGone):
            await reader.info(1)

        expected = deployment.reader().load(5)
        assert len(tensors) == len(manifest.tensors) == len(expected) == len(rank_tensors)
        assert all(torch.equal(rank_tensors[name], t) for name, t in tensors.items())

        stuck = asyncio.create_task(reader.wait_for_newer(5, timeout=3600))
        await asyncio.to_thread(
            wait_for, lambda: subscribers(deployment.client, events) > 0, 60, "the subscription"
        )
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        # Its thread stopped too (it unsubscribed), long before the hour it was given.
        await asyncio.to_thread(
            wait_for, lambda: subscribers(deployment.client, events) == 0, 60, "the thread"
        )
        await reader.report_loaded(5)
        await reader.close()

    asyncio.run(scenario())
    assert json.loads(deployment.client.hget(deployment.keys.nodes, "node-async"))["version"] == 5
