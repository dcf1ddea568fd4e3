"""Replacing a snapshot directory while someone reads it: the trainer's swap, the publisher's
move aside of only the directory it judged."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast.runtime import durable
from weightcast.runtime.durable import exchange_dirs, replace_dir
from weightcast_publisher.snapshot_scan import Snapshot, dir_id, discard, set_aside


def a_dir(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "weightcast.json").write_text(content)
    return path


def test_replace_dir_swaps_atomically_so_a_reader_never_finds_the_name_missing(
    tmp_path: Path,
) -> None:
    final = a_dir(tmp_path / "step-5", "0")
    if not exchange_dirs(a_dir(tmp_path / "probe", "x"), final):
        pytest.skip("this filesystem has no RENAME_EXCHANGE")
    exchange_dirs(tmp_path / "probe", final)  # back as it was
    missing, done = [], threading.Event()

    def read() -> None:
        while not done.is_set():
            if not (final / "weightcast.json").is_file():
                missing.append(1)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(1, 200):
            assert replace_dir(a_dir(tmp_path / ".tmp-step-5", str(n)), final)
    finally:
        done.set()
        reader.join()
    assert not missing
    assert (final / "weightcast.json").read_text() == "199"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe", "step-5"]  # old ones gone


def test_replace_dir_without_exchange_takes_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "exchange_dirs", lambda a, b: False)
    final = a_dir(tmp_path / "step-5", "old")
    assert not replace_dir(a_dir(tmp_path / ".tmp-step-5", "new"), final)
    assert (final / "weightcast.json").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["step-5"]


def test_set_aside_moves_only_the_directory_that_was_judged(tmp_path: Path) -> None:
    path = a_dir(tmp_path / "step-5", "broken")
    judged = dir_id(path)
    path.rename(tmp_path / ".trash-old")  # the trainer writes step 5 again meanwhile
    a_dir(path, "good")
    assert not set_aside(path, judged, tmp_path / "quarantined")
    assert (path / "weightcast.json").read_text() == "good"  # moved back, untouched
    assert not (tmp_path / "quarantined").exists()

    assert set_aside(path, dir_id(path), tmp_path / "quarantined")
    assert not path.exists() and (tmp_path / "quarantined").is_dir()
    assert not set_aside(path, judged, tmp_path / "again")  # gone: nothing to move


def test_discard_deletes_a_handled_snapshot_but_not_one_written_again_since(tmp_path: Path) -> None:
    path = a_dir(tmp_path / "step-5", "handled")
    info = SnapshotInfo("id", "run", 5, 0.0, "bfloat16", "m", "dcp-safetensors/1", ())
    handled = Snapshot(path, info, dir_id(path))
    replace_dir(a_dir(tmp_path / ".tmp-step-5", "new"), path)  # the trainer, after the scan
    discard(handled)
    assert [p.name for p in tmp_path.iterdir()] == ["step-5"]
    assert (path / "weightcast.json").read_text() == "new"
    discard(Snapshot(path, info, dir_id(path)))
    assert not list(tmp_path.iterdir())
