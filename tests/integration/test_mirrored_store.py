"""The publisher's one store when nodes read a bucket: its weights directory mirrored to a
real S3 server (SeaweedFS, started by the tests). A version is sent as the writer writes it and
finished from the directory; it is removed and trimmed in the bucket first, then in the
directory; a live version the bucket lost is restored from the directory's copy."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from weightcast.contract.manifest import MANIFEST_NAME, sha256_bytes
from weightcast.local.s3_server import S3Server
from weightcast.store.base import HELD, LOST, RESTORED
from weightcast.store.directory import DirectoryStore
from weightcast.store.factory import publisher_store
from weightcast.store.mirror import MirroredStore
from weightcast.store.s3 import PART_BYTES, S3Store

from helpers.files import VERSION_FILES as FILES
from helpers.files import version_dir
from helpers.s3 import s3_client

WEIGHTS = "model.vllm-fused"
pytestmark = pytest.mark.usefixtures("s3_env")  # the server's keys in the environment


@pytest.fixture
def mirrored(tmp_path: Path, s3_server: S3Server, s3_bucket: str) -> Iterator[MirroredStore]:
    url = f"s3://{s3_bucket}/run?addressing_style=path&endpoint_url={s3_server.endpoint_url}"
    store = publisher_store(tmp_path / "weights", url, retry_seconds=5)
    assert isinstance(store, MirroredStore)
    yield store
    store.close()


def bucket_files(server: S3Server, bucket: str, name: str) -> dict[str, bytes]:
    """Version ``name``'s objects as the bucket holds them, read with a plain S3 client."""
    client = s3_client(server)
    listing = client.list_objects_v2(Bucket=bucket, Prefix=f"run/{name}/").get("Contents", [])
    return {
        item["Key"].rsplit("/", 1)[1]: client.get_object(Bucket=bucket, Key=item["Key"])[
            "Body"
        ].read()
        for item in listing
    }


def test_a_version_is_sent_as_written_and_read_by_nodes_from_the_bucket(
    mirrored: MirroredStore, s3_server: S3Server, s3_bucket: str
) -> None:
    weights_dir = mirrored.local.root
    head, tail = os.urandom(PART_BYTES), b"tail"
    write = mirrored.begin_version("v1")
    upload = write.file(WEIGHTS)
    assert upload is not None
    upload.part(2, tail)  # parts come in the writer's order, not the file's
    upload.part(1, head)
    upload.complete()
    files = FILES | {WEIGHTS: head + tail}
    assert write.directory == weights_dir / ".tmp-v1"  # the writer writes in the directory
    for file, data in files.items():
        (write.directory / file).write_bytes(data)
    assert write.finish(write.directory) == 3  # the weights were sent already: the other three
    assert {p.name: p.read_bytes() for p in (weights_dir / "v1").iterdir()} == files
    assert bucket_files(s3_server, s3_bucket, "v1") == files
    with mirrored.open_version("v1") as stored:  # nodes read the bucket
        assert stored.read_small(MANIFEST_NAME, 100) == FILES[MANIFEST_NAME]
    aborted = mirrored.begin_version("v2")
    second = aborted.file(WEIGHTS)
    assert second is not None
    second.part(1, b"x")
    second.complete()
    aborted.abort()  # a failed convert: what was sent goes
    assert bucket_files(s3_server, s3_bucket, "v2") == {}


def test_a_version_is_removed_and_trimmed_in_the_bucket_first(
    mirrored: MirroredStore, s3_server: S3Server, s3_bucket: str
) -> None:
    weights_dir = mirrored.local.root
    for name in ("v1", "v2"):
        mirrored.remote.begin_version(name).finish(
            version_dir(weights_dir.parent / "elsewhere", name, FILES)
        )
    version_dir(weights_dir, "v2", FILES)
    version_dir(weights_dir, "v3", FILES)
    version_dir(weights_dir, ".tmp-v4", FILES)
    assert mirrored.version_names() == ["v1", "v2", "v3"]
    assert mirrored.remove_unfinished()[0] == ".tmp-v4"

    class ReadOnlyDirectory(DirectoryStore):
        def trim_version(self, name: str, keep: Collection[str]) -> None:
            raise OSError("read-only file system")

    failing = MirroredStore(ReadOnlyDirectory(weights_dir), mirrored.remote)
    with pytest.raises(OSError, match="read-only"):
        failing.trim_version("v2", {MANIFEST_NAME})
    assert bucket_files(s3_server, s3_bucket, "v2") == {MANIFEST_NAME: FILES[MANIFEST_NAME]}
    mirrored.trim_version("v2", {MANIFEST_NAME})
    assert [p.name for p in (weights_dir / "v2").iterdir()] == [MANIFEST_NAME]
    mirrored.remove_version("v2")
    assert bucket_files(s3_server, s3_bucket, "v2") == {}
    assert not (weights_dir / "v2").exists()


def test_a_live_version_the_bucket_lost_is_restored_from_the_directory(
    mirrored: MirroredStore, s3_server: S3Server, s3_bucket: str
) -> None:
    weights_dir = mirrored.local.root
    local = version_dir(weights_dir, "v3", FILES)
    registered = sha256_bytes(FILES[MANIFEST_NAME])
    s3_client(s3_server).put_object(Bucket=s3_bucket, Key=f"run/v3/{WEIGHTS}", Body=b"half")
    assert mirrored.restore_version("v3", local, registered) == RESTORED
    assert bucket_files(s3_server, s3_bucket, "v3") == FILES
    assert mirrored.restore_version("v3", local, registered) == HELD
    assert mirrored.restore_version("v4", weights_dir / "v4", registered) == LOST
    assert mirrored.restore_version("v3", local, "0" * 64) == LOST  # the copy is another version
    assert isinstance(mirrored.remote, S3Store)
