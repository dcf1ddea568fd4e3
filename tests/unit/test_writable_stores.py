"""The publisher's side of a store: the weights directory's (write in place, remove, trim,
sweep), and the directory mirrored to a bucket (the bucket here an in-memory stand-in; the
real one: tests/integration/test_s3_store.py)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Self

import pytest

from weightcast.contract.errors import ConfigError, WeightsError
from weightcast.contract.manifest import MANIFEST_NAME, sha256_bytes
from weightcast.store.base import HELD, LOST, RESTORED, WritableStore
from weightcast.store.directory import DirectoryStore
from weightcast.store.factory import publisher_store
from weightcast.store.mirror import MirroredStore


def version(root: Path, name: str, files: dict[str, bytes]) -> Path:
    path = root / name
    path.mkdir(parents=True)
    for file, data in files.items():
        (path / file).write_bytes(data)
    return path


FILES = {
    "model.vllm-fused": b"w" * 10,
    "config.json": b"{}",
    MANIFEST_NAME: b'{"m": 1}',
    "delta-from-v1.xor-zstd": b"d",
}


def test_the_directory_lists_removes_and_trims_its_versions(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    version(tmp_path, "v1", FILES)
    version(tmp_path, "v2", FILES)
    version(tmp_path, "v1.bak", FILES)
    assert store.version_names() == ["v1", "v2"]
    keep = {MANIFEST_NAME, "config.json", "delta-from-v1.xor-zstd"}
    store.trim_version("v2", keep)
    assert {p.name for p in (tmp_path / "v2").iterdir()} == keep
    store.trim_version("v2", keep)  # a trimmed version stays as it is
    store.trim_version("v9", keep)  # and a missing one is no error
    store.remove_version("v1")
    store.remove_version("v1")
    assert store.version_names() == ["v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.bak", "v2"]
    with pytest.raises(WeightsError, match="not a plain file name"):
        store.remove_version("../v2")


def test_the_directory_sweeps_what_an_interrupted_write_left(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    version(tmp_path, ".tmp-v3", FILES)
    version(tmp_path, ".tmp-v2-delta-only", FILES)
    version(tmp_path, ".trash-v1-123", FILES)
    version(tmp_path, "v2", FILES)
    assert sorted(store.remove_unfinished()) == [".tmp-v2-delta-only", ".tmp-v3", ".trash-v1-123"]
    assert [p.name for p in tmp_path.iterdir()] == ["v2"]


def test_a_version_written_in_the_directory_sends_nothing(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    write = store.begin_version("v1")
    assert write.file("model.vllm-fused") is None
    local = version(tmp_path, "v1", FILES)
    assert write.finish(local) == 0
    assert store.restore_version("v1", local, "0" * 64) == HELD  # it is the copy itself


class Bucket(WritableStore):
    """A bucket in memory: versions of files, and what was done to them, in order."""

    def __init__(self) -> None:
        self.label = "mem://bucket/"
        self.versions: dict[str, dict[str, bytes]] = {}
        self.calls: list[str] = []

    def check(self) -> None:
        self.calls.append("check")

    def open_version(self, path: str) -> BucketVersion:
        return BucketVersion(self.versions.get(path, {}))

    def close(self) -> None:
        self.calls.append("close")

    def begin_version(self, name: str) -> BucketWrite:
        return BucketWrite(self, name)

    def remove_version(self, name: str) -> None:
        self.calls.append(f"remove {name}")
        self.versions.pop(name, None)

    def trim_version(self, name: str, keep: Collection[str]) -> None:
        self.calls.append(f"trim {name}")
        files = self.versions.get(name, {})
        self.versions[name] = {f: d for f, d in files.items() if f in keep}

    def version_names(self) -> list[str]:
        return sorted(self.versions)

    def remove_unfinished(self) -> list[str]:
        return ["1 unfinished uploads"]


class BucketVersion:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read_small(self, name: str, limit: int, expected_bytes: int | None = None) -> bytes:
        if name not in self.files:
            raise WeightsError(f"{name}: no such object")
        return self.files[name]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class BucketPart:
    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}
        self.completed = False

    def part(self, number: int, data: bytes | memoryview) -> None:
        self.parts[number] = bytes(data)

    def complete(self) -> None:
        self.completed = True

    def abort(self) -> None:
        pass


class BucketWrite:
    def __init__(self, bucket: Bucket, name: str) -> None:
        self.bucket, self.name = bucket, name
        self.uploads: dict[str, BucketPart] = {}

    def file(self, name: str) -> BucketPart:
        upload = self.uploads[name] = BucketPart()
        return upload

    def finish(self, local: Path) -> int:
        files = self.bucket.versions.setdefault(self.name, {})
        for file, upload in self.uploads.items():
            files[file] = b"".join(upload.parts[n] for n in sorted(upload.parts))
        names = sorted(p.name for p in local.iterdir() if p.name not in self.uploads)
        for name in sorted(names, key=lambda n: n == MANIFEST_NAME):
            files[name] = (local / name).read_bytes()
            self.bucket.calls.append(f"put {self.name}/{name}")
        return len(names)

    def abort(self) -> None:
        self.bucket.calls.append(f"abort {self.name}")
        self.bucket.versions.pop(self.name, None)


def test_a_mirrored_version_is_sent_as_written_and_finished_manifest_last(
    tmp_path: Path,
) -> None:
    bucket = Bucket()
    store = MirroredStore(DirectoryStore(tmp_path), bucket)
    assert store.label == bucket.label
    write = store.begin_version("v1")
    upload = write.file("model.vllm-fused")
    assert upload is not None
    upload.part(2, b"w" * 4)
    upload.part(1, b"w" * 6)
    upload.complete()
    local = version(tmp_path, "v1", FILES)
    assert write.finish(local) == 3  # the other files, the manifest last
    assert bucket.calls[-1] == f"put v1/{MANIFEST_NAME}"
    assert bucket.versions["v1"] == FILES
    with store.open_version("v1") as stored:  # nodes read the bucket
        assert stored.read_small(MANIFEST_NAME, 100) == FILES[MANIFEST_NAME]
    store.begin_version("v2").abort()
    assert bucket.calls[-1] == "abort v2"


def test_a_mirrored_version_is_removed_and_trimmed_in_the_bucket_then_here(
    tmp_path: Path,
) -> None:
    bucket = Bucket()
    store = MirroredStore(DirectoryStore(tmp_path), bucket)
    for name in ("v1", "v2"):
        bucket.versions[name] = dict(FILES)
    version(tmp_path, "v2", FILES)
    version(tmp_path, "v3", FILES)
    version(tmp_path, ".tmp-v4", FILES)
    assert store.version_names() == ["v1", "v2", "v3"]
    assert store.remove_unfinished() == [".tmp-v4", "1 unfinished uploads"]

    class Failing(DirectoryStore):
        def trim_version(self, name: str, keep: Collection[str]) -> None:
            raise OSError("read-only file system")

    failing = MirroredStore(Failing(tmp_path), bucket)
    with pytest.raises(OSError):
        failing.trim_version("v2", {MANIFEST_NAME})
    assert bucket.versions["v2"] == {MANIFEST_NAME: FILES[MANIFEST_NAME]}  # the bucket first
    store.trim_version("v2", {MANIFEST_NAME})
    assert [p.name for p in (tmp_path / "v2").iterdir()] == [MANIFEST_NAME]
    store.remove_version("v2")
    assert "v2" not in bucket.versions and not (tmp_path / "v2").exists()


def test_a_live_version_the_bucket_lacks_is_restored_from_the_directory(tmp_path: Path) -> None:
    bucket = Bucket()
    store = MirroredStore(DirectoryStore(tmp_path), bucket)
    local = version(tmp_path, "v3", FILES)
    registered = sha256_bytes(FILES[MANIFEST_NAME])
    bucket.versions["v3"] = {"model.vllm-fused": b"half"}  # an interrupted upload's
    assert store.restore_version("v3", local, registered) == RESTORED
    assert bucket.versions["v3"] == FILES
    assert store.restore_version("v3", local, registered) == HELD
    assert store.restore_version("v4", tmp_path / "v4", registered) == LOST
    assert store.restore_version("v3", local, "0" * 64) == LOST  # the copy is another version


def test_the_publisher_holds_its_directory_or_the_directory_mirrored(tmp_path: Path) -> None:
    plain = publisher_store(tmp_path)
    assert isinstance(plain, DirectoryStore) and plain.root == tmp_path.resolve()
    with pytest.raises(ConfigError, match="not an object store"):
        publisher_store(tmp_path, str(tmp_path / "elsewhere"))
