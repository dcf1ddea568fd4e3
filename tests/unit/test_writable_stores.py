"""The publisher's side of the weights directory's store: write aside then rename, remove,
trim, sweep (the directory mirrored to a real bucket: tests/integration/test_mirrored_store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightcast.contract.errors import ConfigError, WeightsError
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.store.base import HELD
from weightcast.store.directory import DirectoryStore
from weightcast.store.factory import publisher_store

from helpers.files import VERSION_FILES as FILES
from helpers.files import version_dir


def test_the_directory_lists_removes_and_trims_its_versions(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    version_dir(tmp_path, "v1", FILES)
    version_dir(tmp_path, "v2", FILES)
    version_dir(tmp_path, "v1.bak", FILES)
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
    version_dir(tmp_path, ".tmp-v3", FILES)
    version_dir(tmp_path, ".tmp-v2-delta-only", FILES)
    version_dir(tmp_path, ".trash-v1-123", FILES)
    version_dir(tmp_path, "v2", FILES)
    assert sorted(store.remove_unfinished()) == [".tmp-v2-delta-only", ".tmp-v3", ".trash-v1-123"]
    assert [p.name for p in tmp_path.iterdir()] == ["v2"]


def test_a_version_is_written_aside_and_renamed_whole_into_the_directory(
    tmp_path: Path,
) -> None:
    """The writer writes in .tmp-v<N>/ (what a kill leaves there is swept at the next start);
    finish renames it to v<N>/, so a v<N>/ directory is always whole; nothing is sent."""
    store = DirectoryStore(tmp_path / "weights")
    (tmp_path / "weights" / ".tmp-v1").mkdir(parents=True)  # a killed earlier try of v1
    (tmp_path / "weights" / ".tmp-v1" / "stale").write_bytes(b"x")
    write = store.begin_version("v1")
    assert write.directory == store.root / ".tmp-v1" and list(write.directory.iterdir()) == []
    assert write.file("model.vllm-fused") is None
    (write.directory / "hf").mkdir()
    for file, data in FILES.items():
        (write.directory / file).write_bytes(data)
    assert store.version_names() == []
    assert write.finish(write.directory) == 0
    assert write.final == store.root / "v1" and store.version_names() == ["v1"]
    assert sorted(p.name for p in write.final.iterdir()) == sorted([*FILES, "hf"])
    assert sorted(p.name for p in store.root.iterdir()) == ["v1"]
    assert store.restore_version("v1", write.final, "0" * 64) == HELD  # it is the copy itself
    with pytest.raises(WeightsError, match="not a version directory"):
        store.begin_version("v1.bak")


def test_an_aborted_or_failed_write_leaves_nothing(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    aborted = store.begin_version("v2")
    (aborted.directory / "model.vllm-fused").write_bytes(b"w")
    aborted.abort()
    failed = store.begin_version("v3")
    (failed.directory / MANIFEST_NAME).write_bytes(b"{}")
    version_dir(tmp_path, "v3", FILES)  # the rename cannot replace a full directory
    with pytest.raises(OSError):
        failed.finish(failed.directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]
    assert (tmp_path / "v3" / MANIFEST_NAME).read_bytes() == FILES[MANIFEST_NAME]


def test_the_publisher_holds_its_directory_or_the_directory_mirrored(tmp_path: Path) -> None:
    plain = publisher_store(tmp_path)
    assert isinstance(plain, DirectoryStore) and plain.root == tmp_path.resolve()
    with pytest.raises(ConfigError, match="not an object store"):
        publisher_store(tmp_path, str(tmp_path / "elsewhere"))
