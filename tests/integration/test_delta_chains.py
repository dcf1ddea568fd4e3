"""Delta chains end to end with the real publisher: a node that keeps its base and skipped
versions applies the deltas of the versions between (live or delta-only) and lands bitwise
on the newest, reading far less than the version; a link that is gone, lies, or breaks
mid-chain leaves the held tensors bitwise the version held and the newest is read whole;
the publisher keeps evicted versions' deltas for its window, never touching a leased one."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from weightcast.cli.status import collect_status, format_status
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import VersionGone, WeightsError
from weightcast.contract.events import Evicted, parse_event
from weightcast.contract.keys import Keys
from weightcast.contract.leases import Leases
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, sha256_bytes
from weightcast.local.redis_server import RedisServer

from helpers.models import drift, hf_state, shape_of
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment, same

TP = 2
SHAPE = dataclasses.replace(shape_of(8, 8, 32, hidden=256, inter=1024, tied=False), vocab_size=1024)
WEIGHTS = "model.vllm-fused"


class Run:
    """The real publisher (tp 2, deltas on, keep 2) fed snapshots that drift like RL steps."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.state = hf_state(SHAPE, torch.bfloat16)
        self.step = 0

    def publish(self) -> int:
        self.step += 1
        if self.step > 1:
            drift(self.state, self.step)
        write_snapshot(self.deployment.root / "checkpoints", self.step, SHAPE, self.state)
        self.deployment.publisher.scan_once()
        return int(self.deployment.client.get(self.deployment.keys.latest))

    def dir(self, version: int) -> Path:
        return self.deployment.root / "weights" / f"v{version}"

    def manifest(self, version: int) -> Manifest:
        return Manifest.read(self.dir(version))

    def live(self) -> list[int]:
        return self.deployment.registry.live_versions()

    def deltas(self) -> list[int]:
        return self.deployment.evictor.delta_versions()


@pytest.fixture
def run(client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer) -> Run:
    return Run(Deployment(client, keys, tmp_path, redis_server.url, tp=TP, shape=SHAPE))


def keeping(run: Run, max_delta_chain: int = 16) -> WeightsClient:
    return run.deployment.reader(keep_base=True, max_delta_chain=max_delta_chain)


def copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def held_at(run: Run, rank: int = 0) -> tuple[WeightsClient, dict[str, torch.Tensor], int]:
    """A keep-base node holding rank ``rank`` of a first version, which then falls 4 versions
    behind (two of them delta-only by then); its tensors and the newest version."""
    node = keeping(run)
    held = node.rank_tensors(run.publish(), rank, TP)
    for _ in range(4):
        newest = run.publish()
    assert run.live() == [newest - 1, newest] and run.deltas() == [newest - 3, newest - 2]
    return node, held, newest


def test_a_node_four_versions_behind_lands_bitwise_on_the_newest_by_the_chain(run: Run) -> None:
    node, held, newest = held_at(run)
    full = run.deployment.reader()
    mine = node.rank_tensors(newest, 0, TP)
    stats = node.reader.stats
    assert (stats.via, stats.links, stats.reason) == ("chain", 4, "")
    assert same(mine, full.rank_tensors(newest, 0, TP))
    assert same(held, mine)  # the tensors returned before were updated in place
    assert stats.bytes_read < full.reader.stats.bytes_read / 4
    keys = run.deployment.keys
    assert not any(run.deployment.client.zcard(keys.leases(v)) for v in range(1, newest + 1))


def test_a_whole_model_node_chains_and_then_reads_the_next_by_delta(run: Run) -> None:
    node = keeping(run)
    held = node.load(run.publish())
    for _ in range(3):
        newest = run.publish()
    full = run.deployment.reader()
    assert same(node.load(newest), full.load(newest))
    assert (node.reader.stats.via, node.reader.stats.links) == ("chain", 3)
    assert node.reader.stats.bytes_read < full.reader.stats.bytes_read / 4
    assert same(held, full.load(newest))  # the tensors returned before, updated in place
    following = run.publish()
    assert same(node.load(following), run.deployment.reader().load(following))
    assert (node.reader.stats.via, node.reader.stats.links) == ("delta", 1)


def full_read_after_refused_chain(run: Run, damage: Callable[[int], None], reason: str) -> None:
    """A node 4 versions behind whose chain ``damage(newest)`` breaks reads the newest
    whole (``reason`` in why), its earlier tensors still, bitwise, the version it held."""
    node, held, newest = held_at(run)
    kept = copies(held)
    damage(newest)
    mine = node.rank_tensors(newest, 0, TP)
    stats = node.reader.stats
    assert stats.via == "full" and reason in stats.reason, stats.reason
    assert same(mine, run.deployment.reader().rank_tensors(newest, 0, TP))
    assert same(held, kept), "the tensors held before were changed"


def test_a_link_whose_manifest_lies_gives_a_full_read(run: Run) -> None:
    def lie(newest: int) -> None:
        path = run.dir(newest - 2) / MANIFEST_NAME
        path.write_bytes(path.read_bytes().replace(b'"step": ', b'"step":  '))

    full_read_after_refused_chain(run, lie, "sha256 differs from the registry's manifest_sha256")


def test_a_link_whose_delta_is_from_another_version_gives_a_full_read(run: Run) -> None:
    """The registry's ``delta_from`` found the chain; the link's manifest, checked against
    its registry digest, says otherwise: no byte changes, the reason names the link."""

    def relink(newest: int) -> None:
        link = newest - 2
        manifest = run.manifest(link)
        assert manifest.delta is not None
        delta = dataclasses.replace(manifest.delta, base_version=link - 2)
        text = dataclasses.replace(manifest, delta=delta).to_json().encode()
        (run.dir(link) / MANIFEST_NAME).write_bytes(text)
        key = run.deployment.keys.version(link)
        run.deployment.client.hset(key, "manifest_sha256", sha256_bytes(text))

    newest = 5  # held_at: v1 held, v2 to v5 published after it
    full_read_after_refused_chain(
        run,
        relink,
        f"link {newest - 2}: the delta of version {newest - 2} is from version {newest - 4}; "
        f"the link before it is version {newest - 3}",
    )


def test_a_missing_link_directory_gives_a_full_read(run: Run) -> None:
    full_read_after_refused_chain(
        run, lambda newest: shutil.rmtree(run.dir(newest - 3)), "the delta chain failed: link"
    )


def test_a_link_evicted_from_the_registry_gives_a_full_read(run: Run) -> None:
    def evict(newest: int) -> None:
        assert Leases(run.deployment.client, run.deployment.keys).evict(newest - 2)

    full_read_after_refused_chain(run, evict, "(a link of the chain) is gone")


def test_a_broken_frame_mid_chain_reverts_every_link_and_the_version_is_read_whole(
    run: Run,
) -> None:
    def flip(newest: int) -> None:  # the third of four links: two are applied when it breaks
        link = newest - 1
        manifest = run.manifest(link)
        assert manifest.delta is not None
        offset, _ = next(f for f in manifest.delta.frames(WEIGHTS) if f[1])
        path = run.dir(link) / manifest.delta.file
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF  # its zstd magic: no frame (a byte inside may decode to
        # other bytes, which the block digest refuses: test_delta_reads covers that)
        path.write_bytes(bytes(data))

    full_read_after_refused_chain(run, flip, "the delta chain failed: a delta frame does not")


def test_a_chain_longer_than_the_bound_gives_a_full_read(run: Run) -> None:
    node, held, newest = held_at(run)
    node.reader.max_delta_chain = 3
    kept = copies(held)
    mine = node.rank_tensors(newest, 0, TP)
    assert node.reader.stats.via == "full"
    assert node.reader.stats.reason.endswith("the chain from version 1 is longer than 3 deltas")
    assert same(mine, run.deployment.reader().rank_tensors(newest, 0, TP))
    assert same(held, kept)


def test_a_chain_larger_than_the_version_is_not_applied(run: Run) -> None:
    """Versions that share nothing: each delta kept (delta_max_ratio 1.0) is about the
    version's size, so three together are larger than reading the newest whole."""
    publisher = run.deployment.publisher
    publisher.publishing.options = dataclasses.replace(
        publisher.publishing.options, delta_max_ratio=1.0
    )
    node = keeping(run)
    node.rank_tensors(run.publish(), 0, TP)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for tensor in run.state.values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
        newest = run.publish()
        assert run.manifest(newest).delta is not None
    mine = node.rank_tensors(newest, 0, TP)
    assert node.reader.stats.via == "full"
    assert "; no chain of deltas: the chain of 3 deltas (" in node.reader.stats.reason
    assert "is not smaller than the version" in node.reader.stats.reason
    assert same(mine, run.deployment.reader().rank_tensors(newest, 0, TP))


def test_delta_only_versions_are_not_live_for_older_clients(run: Run) -> None:
    _, _, newest = held_at(run)
    client = run.deployment.reader()
    for version in run.deltas():
        with pytest.raises(VersionGone):
            client.info(version)
        with pytest.raises(VersionGone):
            client.lease(version)
        assert sorted(p.name for p in run.dir(version).iterdir()) == sorted(
            ["config.json", MANIFEST_NAME, f"delta-from-v{version - 1}.xor-sparse"]
        )
    assert int(run.deployment.client.get(run.deployment.keys.latest)) == newest
    status = collect_status(run.deployment.client, run.deployment.keys)
    assert [v.version for v in status.versions] == run.live() == [newest - 1, newest]
    assert status.delta_only == run.deltas() == [newest - 3, newest - 2]
    shown = f"delta-only (links of delta chains): v{newest - 3}, v{newest - 2}"
    assert shown in format_status(status)


def test_the_publisher_keeps_deltas_for_its_window_and_never_touches_a_leased_one(
    run: Run,
) -> None:
    run.deployment.evictor.delta_window = 2
    events = run.deployment.client.pubsub()
    events.subscribe(run.deployment.keys.events)
    for _ in range(6):
        newest = run.publish()
    assert run.live() == [5, 6] and run.deltas() == [3, 4]
    assert sorted(p.name for p in (run.deployment.root / "weights").iterdir()) == [
        "v3", "v4", "v5", "v6",
    ]  # fmt: skip
    leases = Leases(run.deployment.client, run.deployment.keys)
    leases.take_link(3, "chain-reader", 60_000)  # a link being read
    leases.take(5, "full-reader", 60_000)  # a version being read whole
    run.publish()
    run.publish()  # 3 and 4 are past the window, 5 and 6 past keep
    assert run.live() == [5, 7, 8] and run.deltas() == [3, 6]
    assert (run.dir(5) / WEIGHTS).exists() and (run.dir(3) / MANIFEST_NAME).exists()
    assert not run.dir(4).exists() and not (run.dir(6) / WEIGHTS).exists()
    leases.release(3, "chain-reader")
    leases.release(5, "full-reader")
    newest = run.publish()
    assert run.live() == [8, 9] and run.deltas() == [6, 7]
    assert sorted(p.name for p in (run.deployment.root / "weights").iterdir()) == [
        "v6", "v7", "v8", "v9",
    ]  # fmt: skip
    assert newest == 9
    evicted = []  # once per version, when it stops being live (trimmed or evicted whole)
    while message := events.get_message(timeout=0.2):
        if message["type"] != "message":
            continue
        event = parse_event(message["data"])
        if isinstance(event, Evicted):
            evicted.append(event.version)
    assert sorted(evicted) == [1, 2, 3, 4, 5, 6, 7]
    events.close()


def test_a_window_of_zero_evicts_whole_as_before(run: Run) -> None:
    run.deployment.evictor.delta_window = 0
    for _ in range(4):
        run.publish()
    assert run.live() == [3, 4] and run.deltas() == []
    assert sorted(p.name for p in (run.deployment.root / "weights").iterdir()) == ["v3", "v4"]


def test_a_version_without_a_delta_ends_the_window(run: Run) -> None:
    for _ in range(3):
        run.publish()
    run.deployment.publisher.publishing.options = dataclasses.replace(
        run.deployment.publisher.publishing.options, delta=False
    )
    run.publish()  # v4: no delta, no chain can cross it
    run.deployment.publisher.publishing.options = dataclasses.replace(
        run.deployment.publisher.publishing.options, delta=True
    )
    run.publish()
    run.publish()
    assert run.live() == [5, 6] and run.deltas() == []  # v3's delta could link nothing
    assert sorted(p.name for p in (run.deployment.root / "weights").iterdir()) == ["v5", "v6"]


def test_a_restarted_publisher_finishes_a_trim_a_crash_interrupted(run: Run) -> None:
    _, _, newest = held_at(run)
    version = run.deltas()[0]
    shutil.copy(run.dir(newest) / WEIGHTS, run.dir(version) / WEIGHTS)  # as before the trim
    (run.deployment.root / "weights" / f".tmp-v{version}-delta-only").mkdir()
    run.deployment.publisher.housekeeping.clean_weights_dir()
    assert not (run.dir(version) / WEIGHTS).exists()
    assert (run.dir(version) / MANIFEST_NAME).exists()
    assert not (run.deployment.root / "weights" / f".tmp-v{version}-delta-only").exists()


def test_a_version_refused_at_the_end_of_its_chain_leaves_the_held_tensors_as_they_were(
    run: Run,
) -> None:
    """One rollback rule for a chain as for one delta: the newest's header and tensor parts
    are checked on the blocks every link rebuilt; a tensor its manifest lies about refuses
    the version and every link is changed back (the held tensors bitwise the version held,
    the base still that version)."""
    node, held, newest = held_at(run)
    kept = copies(held)
    path = run.dir(newest) / MANIFEST_NAME
    manifest = Manifest.read(run.dir(newest))
    tensors = [
        dataclasses.replace(t, dtype="float16") if t.name == "model.norm.weight" else t
        for t in manifest.tensors
    ]
    text = dataclasses.replace(manifest, tensors=tensors).to_json().encode()
    path.write_bytes(text)
    version_key = run.deployment.keys.version(newest)
    run.deployment.client.hset(version_key, "manifest_sha256", sha256_bytes(text))
    with pytest.raises(WeightsError, match=r"tensor model\.norm\.weight is missing or not float16"):
        node.rank_tensors(newest, 0, TP)
    assert same(held, kept), "the tensors held before were changed"
    assert node.reader.base is not None and node.reader.base.version == newest - 4


def test_a_link_whose_manifest_lists_none_of_the_parts_files_gives_a_full_read(run: Run) -> None:
    """A link (its manifest the registry's) that lists no file the node holds of the part:
    the chain cannot rebuild that file, so the newest version is read whole, refused by the
    chain's check before any held byte changed (not refused as the version's own fault)."""

    def rename(newest: int) -> None:
        def renamed(name: str) -> str:
            return f"other{WEIGHTS}" if name == WEIGHTS else name

        base_sha = ""
        for version in range(newest - 2, newest + 1):  # the link, then whatever chains on it
            manifest = run.manifest(version)
            assert manifest.delta is not None
            delta = manifest.delta
            if base_sha:
                delta = dataclasses.replace(delta, base_manifest_sha256=base_sha)
            else:
                files = [dataclasses.replace(f, name=renamed(f.name)) for f in delta.files]
                delta = dataclasses.replace(delta, files=files)
                manifest = dataclasses.replace(
                    manifest,
                    files=[dataclasses.replace(f, name=renamed(f.name)) for f in manifest.files],
                    tensors=[
                        dataclasses.replace(t, file=renamed(t.file)) for t in manifest.tensors
                    ],
                )
            text = dataclasses.replace(manifest, delta=delta).to_json().encode()
            (run.dir(version) / MANIFEST_NAME).write_bytes(text)
            base_sha = sha256_bytes(text)
            key = run.deployment.keys.version(version)
            run.deployment.client.hset(key, "manifest_sha256", base_sha)

    full_read_after_refused_chain(
        run, rename, f"the delta chain failed: the delta does not cover {WEIGHTS}"
    )
