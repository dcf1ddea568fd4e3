"""Versions in a real S3 server (SeaweedFS, started by the tests): the real publisher uploads,
registers and evicts; nodes read their byte ranges, verified, by delta too; hostile and
changed objects are refused; outages of the store and a full bucket are ridden out."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import weightcast.client.node as node_module
from weightcast.client.node import Node
from weightcast.client.reader import VersionReader
from weightcast.contract.errors import StoreFull, StoreUnavailable, WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.contract.snapshot_format import CONFIG_NAME, read_complete
from weightcast.contract.version_info import VersionInfo
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server
from weightcast.store.s3 import (
    PART_BYTES,
    READ_PIECE_BYTES,
    REPLY_BYTES,
    S3Location,
    S3Object,
    S3Store,
)
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot

from helpers.memory import peak_traced
from helpers.models import shape_of
from helpers.s3 import s3_client, store_settings
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment

pytestmark = pytest.mark.usefixtures("s3_env")


@pytest.fixture
def deployment(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: S3Server,
    s3_bucket: str,
) -> Deployment:
    settings = store_settings(s3_server, s3_bucket, retry_seconds=1)
    return Deployment(client, keys, tmp_path, redis_server.url, tp=2, store=settings)


def bucket(deployment: Deployment) -> S3Store:
    """The bucket the publisher's weights directory is mirrored to."""
    store = deployment.bucket()
    assert store is not None
    return store


def objects(deployment: Deployment, prefix: str = "") -> list[str]:
    store = bucket(deployment)
    return sorted(k[len(store.prefix) :] for k in store._keys(store.prefix + prefix))


def info_of(deployment: Deployment, version: int) -> VersionInfo:
    return deployment.reader().info(version)


def test_versions_in_a_bucket_read_bitwise_what_the_directory_holds(
    deployment: Deployment,
) -> None:
    versions = [deployment.publish() for _ in range(3)]
    assert versions == [1, 2, 3]
    local = VersionReader(deployment.root / "weights")
    node = deployment.reader()
    for version in versions[1:]:
        info = node.info(version)
        for rank in range(2):
            got = node.rank_tensors(info, rank, 2)
            expected = local.rank_tensors(info, rank, 2)
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in got)
        assert node.reader.stats.bytes_read < info.bytes  # only the rank's blocks
        node.verify(info)
        assert node.config(info) == local.config(info)
    # keep-last-two: v1 gone from the bucket and from the publisher's copy
    assert {k.split("/")[0] for k in objects(deployment)} == {"v2", "v3"}
    assert sorted(p.name for p in (deployment.root / "weights").iterdir()) == ["v2", "v3"]


def test_a_node_that_keeps_its_base_reads_the_next_version_by_delta_from_the_bucket(
    deployment: Deployment,
) -> None:
    deployment.publish()
    node = deployment.reader()
    node.reader.keep_base = True
    local = VersionReader(deployment.root / "weights")
    for _ in range(3):
        version = int(deployment.client.get(deployment.keys.latest))
        with node.lease(version) as info:
            got = node.rank_tensors(info, 1, 2)
        expected = local.rank_tensors(info, 1, 2)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        deployment.publish()
    assert node.reader.stats.via == "delta", node.reader.stats.reason


def test_a_deployment_moved_to_a_bucket_uploads_its_live_versions_which_nodes_wait_for(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``weights_url`` set on a running deployment: the versions registered before are in
    the weights directory only. A node that asks for the newest before the publisher is back
    waits for it rather than refusing it for good; the publisher's first pass uploads the
    live versions, and the node loads the newest, bitwise what the directory holds."""
    monkeypatch.setattr(node_module, "MISSING_RETRY_S", 0.2)
    on_disk = Deployment(client, keys, tmp_path, redis_server.url, tp=2)
    assert [on_disk.publish() for _ in range(3)] == [1, 2, 3]  # keep-last-two: v2, v3
    on_disk.publisher.lock.release()
    settings = store_settings(s3_server, s3_bucket, retry_seconds=1)
    moved = Deployment(client, keys, tmp_path, redis_server.url, tp=2, store=settings)
    node = Node(moved.reader(), report_every=60)
    node.step(poll=0.1)
    assert (node.current, node.seen, node.missing[0]) == (0, 0, 3)
    moved.publisher.scan_once()
    assert {k.split("/")[0] for k in objects(moved)} == {"v2", "v3"}
    time.sleep(0.2)
    node.step(poll=0.1)
    assert (node.current, node.seen) == (3, 3)
    info = info_of(moved, 3)
    bucket, local = moved.reader(), VersionReader(tmp_path / "weights")
    for rank in range(2):
        got, expected = bucket.rank_tensors(info, rank, 2), local.rank_tensors(info, rank, 2)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)


def test_a_leased_version_keeps_its_objects_until_released(deployment: Deployment) -> None:
    deployment.publish()
    node = deployment.reader(lease_seconds=60)
    lease = node.lease(1)
    lease.__enter__()
    for _ in range(3):
        deployment.publish()
    assert MANIFEST_NAME in {k.split("/", 1)[1] for k in objects(deployment, "v1/")}
    lease.release()
    deployment.publish()
    assert objects(deployment, "v1/") == []


def put(server: S3Server, deployment: Deployment, key: str, body: bytes) -> None:
    store = bucket(deployment)
    s3_client(server).put_object(Bucket=store.bucket, Key=store.prefix + key, Body=body)


def get(server: S3Server, deployment: Deployment, key: str) -> bytes:
    store = bucket(deployment)
    answer = s3_client(server).get_object(Bucket=store.bucket, Key=store.prefix + key)
    return bytes(answer["Body"].read())


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (FUSED_WEIGHTS_FILE, lambda b: flip(b, len(b) - 9), "digest"),
        (FUSED_WEIGHTS_FILE, lambda b: b[:-8], "bytes, the manifest says"),
        (MANIFEST_NAME, lambda b: b.replace(b'"tp": 2', b'"tp": 1 '), "sha256"),
        (CONFIG_NAME, lambda b: flip(b, 5), "digest"),
        (CONFIG_NAME, None, "NoSuchKey|404|not what the manifest says"),
    ],
    ids=["a weights byte", "a short weights object", "the manifest", "config", "config gone"],
)
def test_an_object_changed_after_registration_is_refused(
    deployment: Deployment, s3_server: S3Server, name: str, change: Any, message: str
) -> None:
    deployment.publish()
    key = f"v1/{name}"
    if change is None:
        store = bucket(deployment)
        s3_client(s3_server).delete_object(Bucket=store.bucket, Key=store.prefix + key)
    else:
        put(s3_server, deployment, key, change(get(s3_server, deployment, key)))
    node = deployment.reader()
    info = node.info(1)
    with pytest.raises(WeightsError, match=message):
        node.verify(info)
        node.rank_tensors(info, 0, 2)


def test_an_object_replaced_while_a_node_reads_it_is_refused_not_mixed(
    deployment: Deployment, s3_server: S3Server
) -> None:
    deployment.publish()
    node = deployment.reader()
    store = node.reader.store
    assert isinstance(store, S3Store)
    with store.open_version("v1") as version:
        f = version.open(FUSED_WEIGHTS_FILE)
        first = f.read_at(0, 64)
        put(s3_server, deployment, f"v1/{FUSED_WEIGHTS_FILE}", b"\0" * f.size)
        with pytest.raises(WeightsError, match=r"PreconditionFailed|412"):
            f.read_at(0, 64)
    assert first != b"\0" * 64


def test_an_object_larger_than_an_answer_may_be_opens_and_reads(
    deployment: Deployment, s3_server: S3Server
) -> None:
    """A HEAD's Content-Length is the object's size, with no body: an object over
    ``REPLY_BYTES`` (every real model's weights file) still opens (the real-size tier found
    every bucket read of a 0.6B version refused: ``an answer of more than 4194304 bytes``)."""
    deployment.publish()
    data = bytes(range(256)) * ((REPLY_BYTES + 4096) // 256)
    put(s3_server, deployment, "v1/large", data)
    store = deployment.reader().reader.store
    assert isinstance(store, S3Store)
    with store.open_version("v1") as version, version.open("large") as f:
        assert (f.size, f.read_at(REPLY_BYTES, 256)) == (len(data), data[:256])


@pytest.mark.parametrize("path", ["../run/v1", "/run/v1", "v1/../v1", "", "v1/", "a/./b"])
def test_a_registered_path_that_leaves_the_prefix_is_refused_before_any_request(
    deployment: Deployment, path: str
) -> None:
    deployment.publish()
    node = deployment.reader()
    entry = node.info(1)
    with pytest.raises(WeightsError, match="not plain names"):
        node.reader.manifest(dataclasses.replace(entry, path=path))


def test_leftovers_of_a_killed_upload_are_removed_at_the_next_start_registered_ones_kept(
    deployment: Deployment, s3_server: S3Server
) -> None:
    deployment.publish()
    store = bucket(deployment)
    raw = s3_client(s3_server)
    raw.put_object(Bucket=store.bucket, Key=store.prefix + "v9/config.json", Body=b"{}")
    raw.create_multipart_upload(Bucket=store.bucket, Key=store.prefix + "v9/model.vllm-fused")
    deployment.publisher.housekeeping.clean_weights_dir()
    assert {k.split("/")[0] for k in objects(deployment)} == {"v1"}
    uploads = raw.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    assert uploads.get("Uploads", []) == []
    deployment.reader().verify(info_of(deployment, 1))


@pytest.fixture
def private_deployment(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    private_s3_server: S3Server,
    monkeypatch: pytest.MonkeyPatch,
) -> Deployment:
    for name, value in private_s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    private_s3_server.create_bucket("faults")
    settings = store_settings(private_s3_server, "faults", retry_seconds=1)
    return Deployment(client, keys, tmp_path, redis_server.url, tp=2, store=settings)


def test_a_store_down_mid_publish_registers_nothing_and_the_publisher_resumes(
    private_deployment: Deployment, private_s3_server: S3Server
) -> None:
    deployment = private_deployment
    deployment.publish()
    private_s3_server.kill()
    with pytest.raises(StoreUnavailable):
        deployment.publish()
    assert int(deployment.client.get(deployment.keys.latest)) == 1
    assert sorted(p.name for p in (deployment.root / "weights").iterdir()) == ["v1"]
    private_s3_server.restart()
    deployment.publisher.scan_once()  # the same snapshot, published again
    latest = int(deployment.client.get(deployment.keys.latest))
    assert latest > 1
    deployment.reader().verify(info_of(deployment, latest))


def test_a_node_keeps_what_it_holds_while_the_store_is_down_and_catches_up(
    private_deployment: Deployment, private_s3_server: S3Server
) -> None:
    deployment = private_deployment
    deployment.publish()
    node = Node(deployment.reader(), report_every=60)
    node.step(poll=0.1)
    assert node.current == 1
    deployment.publish()
    private_s3_server.kill()
    node.step(poll=0.1)  # v2 registered, its objects unreachable
    assert (node.current, node.seen) == (1, 1)
    private_s3_server.restart()
    node.step(poll=0.1)
    assert node.current == 2


def test_a_full_bucket_is_reported_and_publishing_resumes_once_there_is_room(
    private_deployment: Deployment, private_s3_server: S3Server
) -> None:
    deployment = private_deployment
    deployment.publish()
    s3_client(private_s3_server).put_object(Bucket="faults", Key="ballast", Body=bytes(2 << 20))
    private_s3_server.fill_bucket_quota("faults")
    # SeaweedFS answers a PUT over quota with a plain 500 InternalError (MinIO says
    # XMinioStorageFull, read as StoreFull): either way nothing is registered, and the
    # daemon's loop retries it with back-off, as a full disk.
    with pytest.raises((StoreFull, StoreUnavailable)):
        deployment.publish()
    assert int(deployment.client.get(deployment.keys.latest)) == 1
    private_s3_server.clear_quota("faults")
    deployment.publisher.scan_once()
    assert int(deployment.client.get(deployment.keys.latest)) > 1


def test_a_node_versions_behind_catches_up_by_a_chain_of_deltas_from_the_bucket(
    deployment: Deployment,
) -> None:
    deployment.publish()
    node = deployment.reader()
    node.reader.keep_base = True
    with node.lease(1) as info:
        node.rank_tensors(info, 0, 2)
    for _ in range(3):
        deployment.publish()
    # v2 is delta-only now: in the bucket, its manifest, config and delta alone
    assert sorted(k.split("/", 1)[1] for k in objects(deployment, "v2/")) == sorted(
        [MANIFEST_NAME, CONFIG_NAME, "delta-from-v1.xor-sparse"]
    )
    with node.lease(4) as info:
        got = node.rank_tensors(info, 0, 2)
    stats = node.reader.stats
    assert (stats.via, stats.links) == ("chain", 3), stats.reason
    expected = VersionReader(deployment.root / "weights").rank_tensors(info, 0, 2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_writer_sends_the_weights_files_as_it_writes_them(
    deployment: Deployment, s3_server: S3Server
) -> None:
    """With a bucket, the weights files are in it once the version is written, before the
    publisher uploads the rest (no second pass over their bytes), byte for byte the files
    written here; the manifest is not (a node could not find the version yet)."""
    store = bucket(deployment)
    big = shape_of(4, 4, 64, hidden=1024, inter=3072)  # 42 MB: three parts
    snapshot = write_snapshot(deployment.root / "snapshots", 1, big)
    at = Snapshot(snapshot, read_complete(snapshot))
    write = store.begin_version("v7")
    published = convert(at, deployment.root / "w", 7, ConvertOptions(), write)
    assert write.sent == {FUSED_WEIGHTS_FILE}
    assert (published.path / FUSED_WEIGHTS_FILE).stat().st_size > 2 * PART_BYTES
    assert objects(deployment, "v7/") == [f"v7/{FUSED_WEIGHTS_FILE}"]
    sent = get(s3_server, deployment, f"v7/{FUSED_WEIGHTS_FILE}")
    assert sent == (published.path / FUSED_WEIGHTS_FILE).read_bytes()


class GetsInFlight:
    """Counts the node's ranged GETs (``S3Object._get``, wrapped) as they run, each held a
    moment first, so that GETs issued one after another cannot overlap and GETs issued
    together do; ``before`` runs just before each GET (and its number)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        before: Callable[[S3Object, int], None] = lambda f, n: None,
    ) -> None:
        self.lock = threading.Lock()
        self.started = self.now = self.most = 0
        self.before = before
        self.get = S3Object._get
        monkeypatch.setattr(S3Object, "_get", lambda f, *a: self.counted(f, *a))

    def counted(self, f: S3Object, offset: int, views: list[memoryview]) -> None:
        with self.lock:
            self.started += 1
            self.now += 1
            self.most = max(self.most, self.now)
            number = self.started
        try:
            time.sleep(0.05)
            self.before(f, number)
            self.get(f, offset, views)
        finally:
            with self.lock:
                self.now -= 1


def test_a_ranks_fetch_keeps_several_gets_in_flight(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's blocks are many small windows (its rows of each tensor); read one after
    another, each GET would wait for the one before it (issue 30's tp-8 fetch)."""
    deployment.publish()
    gets = GetsInFlight(monkeypatch)
    node = deployment.reader()
    info = node.info(1)
    got = node.rank_tensors(info, 0, 2)
    expected = VersionReader(deployment.root / "weights").rank_tensors(info, 0, 2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert gets.started > 4 and gets.most > 2, (gets.started, gets.most)


def test_a_get_failing_mid_fetch_leaves_no_read_writing_into_the_callers_buffers(
    deployment: Deployment, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights object is replaced as the fetch's fourth GET starts, other windows in
    flight: the fetch is refused, and once it has raised no GET runs or starts."""
    deployment.publish()
    key = f"v1/{FUSED_WEIGHTS_FILE}"
    replacement = bytes(len(get(s3_server, deployment, key)))
    others = []

    def replace_at_the_fourth(f: S3Object, number: int) -> None:
        if number == 4:
            # Another GET beside this one: the three before it, or those the fetch starts
            # while it waits (in CI the three had ended before it measured, once).
            deadline = time.monotonic() + 10
            while gets.now < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
            others.append(gets.now - 1)
            put(s3_server, deployment, key, replacement)

    gets = GetsInFlight(monkeypatch, replace_at_the_fourth)
    node = deployment.reader()
    info = node.info(1)
    with pytest.raises(WeightsError, match=r"PreconditionFailed|412"):
        node.rank_tensors(info, 0, 2)
    assert gets.now == 0
    started = gets.started
    time.sleep(0.3)
    assert gets.started == started
    assert not [t for t in threading.enumerate() if t.name.startswith("weightcast-read")]
    assert others and others[0] > 0, others


def test_a_ranged_get_goes_into_its_destination_a_small_piece_at_a_time(
    s3_server: S3Server, s3_bucket: str
) -> None:
    """urllib3's ``readinto`` reads into a new bytes object as large as the view it is given,
    then copies: handed a whole part, each GET in flight held a copy of up to 16 MiB (a node's
    full read from a bucket peaked 190 MB above a directory's at 0.6B, issue 35). Handed a
    small piece at a time, a GET holds only that beside its destination."""
    data = os.urandom(PART_BYTES)
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key="v1/blob", Body=data)
    url = f"s3://{s3_bucket}?addressing_style=path&endpoint_url={s3_server.endpoint_url}"
    store = S3Store(S3Location.parse(url))
    target = bytearray(len(data))
    try:
        with store.open_version("v1").open("blob", len(data)) as f:
            peak = peak_traced(lambda: f.read_into([memoryview(target)], 0))
    finally:
        store.close()
    assert target == data
    assert peak <= 2 * READ_PIECE_BYTES, peak
