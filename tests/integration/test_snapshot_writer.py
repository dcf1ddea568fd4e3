"""The trainer's SnapshotWriter on real files: the dcp-safetensors format the publisher reads,
a weight holding NaN refused with nothing written, a full filesystem skipped and counted, a
step written again after a restart replacing the old one without the publisher ever seeing
the step broken."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file
from torch import nn

from weightcast.contract.errors import WeightcastError
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS, SnapshotInfo, read_complete
from weightcast.local.redis_server import RedisServer
from weightcast.runtime import durable
from weightcast_publisher import snapshot_scan
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot, complete_snapshots
from weightcast_trainer.dcp_safetensors import NonFiniteWeight
from weightcast_trainer.snapshot_writer import SnapshotWriter

from helpers.files import tmpfs
from helpers.models import drift, hf_state, shape_of
from helpers.versions import Deployment

SHAPE = shape_of(4, 2, 16, hidden=32, inter=64, tied=False, bias=True)


class Weights(nn.Module):
    """A model whose state dict is an HF state dict under other names (as torchtitan's)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {}
        for i, (name, tensor) in enumerate(state.items()):
            self.register_buffer(f"t{i}", tensor.clone())
            self.names[f"t{i}"] = name

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.names[key]: value for key, value in state.items()}


def writer_for(directory: Path, model: Weights) -> SnapshotWriter:
    return SnapshotWriter(directory, model.to_hf, SHAPE.to_hf_config(), "test", "run-1")


def entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_snapshot_is_dcp_safetensors_that_the_publisher_reads(tmp_path: Path) -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    model = Weights(state)
    writer = writer_for(tmp_path / "checkpoints", model)
    writer.start(model, 3)
    writer.wait()

    snapshot = tmp_path / "checkpoints" / "step-3"
    info = read_complete(snapshot)
    assert info.format == FORMAT_DCP_SAFETENSORS and info.step == 3
    assert [f.name for f in info.files] == ["shard-00001-model-00001-of-00001.safetensors"]
    assert entries(snapshot) == [
        "config.json",
        "shard-00001-model-00001-of-00001.safetensors",
        "weightcast.json",
    ]
    loaded = load_file(str(snapshot / info.files[0].name))  # a plain safetensors file
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    published = convert(Snapshot(snapshot, info), tmp_path / "weights", 1, ConvertOptions(tp=2))
    assert published.reader == "byte-range"
    verify_files(published.path, Manifest.read(published.path))
    assert writer.written == 1 and writer.skipped_no_space == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_refused_and_nothing_is_written(
    tmp_path: Path, value: float
) -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    model = Weights(state)
    checkpoints = tmp_path / "checkpoints"
    writer = writer_for(checkpoints, model)
    writer.start(model, 1)
    writer.wait()

    poisoned = next(k for k, v in model.to_hf(dict(model.named_buffers())).items() if "v_proj" in k)
    buffer = next(b for k, b in model.named_buffers() if model.names[k] == poisoned)
    buffer.view(-1)[5] = value
    writer.start(model, 2)
    with pytest.raises(NonFiniteWeight, match=f"{poisoned} holds NaN or infinite values") as raised:
        writer.wait()
    assert "the snapshot was not written" in str(raised.value)
    assert isinstance(raised.value, WeightcastError)  # the CLI: one line and exit 1
    assert entries(checkpoints) == ["step-1"]  # no step-2, no .tmp-step-2
    assert writer.written == 1 and writer.last_step == 1


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs: smaller than one snapshot of SHAPE (about 64 KB in bf16)."""
    with tmpfs(tmp_path / "small", "16k") as mount:
        yield mount


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_full_filesystem_skips_the_snapshot_counts_it_and_training_goes_on(
    tiny_filesystem: Path,
) -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    model = Weights(state)
    writer = writer_for(tiny_filesystem, model)
    records = Records()
    logging.getLogger("weightcast").addHandler(records)
    try:
        for step in (1, 2):
            writer.start(model, step)
            writer.wait()  # does not raise: the loop goes on
            assert not writer.busy()
    finally:
        logging.getLogger("weightcast").removeHandler(records)
    assert writer.skipped_no_space == 2 and writer.written == 0
    assert entries(tiny_filesystem) == []  # no step-N, no .tmp-step-N
    skipped = "snapshot skipped: no space left in the checkpoint directory"
    assert sum(m.startswith(skipped) for m in records.messages) == 2
    assert complete_snapshots(tiny_filesystem) == ([], [])

    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_filesystem)], check=True)
    writer.start(model, 3)
    writer.wait()
    assert writer.written == 1 and entries(tiny_filesystem) == ["step-3"]
    read_complete(tiny_filesystem / "step-3")


@pytest.mark.parametrize("atomic", [True, False], ids=["rename-exchange", "two-renames"])
def test_a_step_rewritten_while_the_publisher_reads_it_is_published_never_quarantined(
    redis_server: RedisServer,
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    atomic: bool,
) -> None:
    """A trainer restarted from an earlier step writes step-5 again while the publisher's scan
    reads step-5: the scan lists it, then the replacement runs and is held open where the old
    snapshot is deleted (slow for GBs), then the scan reads. The publisher must not quarantine
    the good snapshot and must publish the new one, with or without ``RENAME_EXCHANGE``."""
    if not atomic:  # a filesystem without RENAME_EXCHANGE (NFS, an old kernel)
        monkeypatch.setattr(durable, "exchange_dirs", lambda tmp, final: False)
    publisher = Deployment(client, keys, tmp_path, redis_server.url).publisher
    checkpoints = tmp_path / "checkpoints"
    model = Weights(hf_state(SHAPE, torch.bfloat16))
    first = writer_for(checkpoints, model)
    first.start(model, 5)
    first.wait()
    publisher.scan_once()
    assert client.get(keys.latest) == b"1"

    drift(dict(model.named_buffers()), 1)  # the rerun of steps 1-5 reached other weights
    rerun = writer_for(checkpoints, model)  # the trainer after its restart
    step = checkpoints / "step-5"
    deleting, finish = threading.Event(), threading.Event()
    rmtree, read = shutil.rmtree, snapshot_scan.read_complete

    def slow_rmtree(path: str | Path, *args, **kwargs) -> None:
        if threading.current_thread().name == "weightcast-snapshot":  # the trainer's writer
            deleting.set()
            assert finish.wait(30)
        rmtree(path, *args, **kwargs)

    def read_during_the_rewrite(path: Path) -> SnapshotInfo:
        if path != step or deleting.is_set():
            return read(path)
        rerun.start(model, 5)  # the scan has listed step-5; the trainer replaces it now
        assert deleting.wait(30), "the trainer never deleted the old snapshot"
        try:
            return read(path)
        finally:
            finish.set()
            rerun.wait()  # the new step-5 is in place before the scan acts on what it read

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    monkeypatch.setattr(snapshot_scan, "read_complete", read_during_the_rewrite)
    publisher.scan_once()
    assert deleting.is_set() and rerun.written == 1
    publisher.scan_once()

    assert client.hlen(keys.quarantine) == 0, client.hvals(keys.quarantine)
    assert [e for e in entries(checkpoints) if e != "quarantine"] == ["step-5"]
    new_id = SnapshotInfo.read(step).snapshot_id
    assert client.get(keys.latest) == b"2"
    assert client.hget(keys.version(2), "snapshot_id") == new_id.encode()


def written(directory: Path) -> dict[str, torch.Tensor]:
    info = read_complete(directory)
    return load_file(str(directory / info.files[0].name))


def test_host_buffers_are_allocated_once_and_each_snapshot_holds_its_steps_weights(
    tmp_path: Path,
) -> None:
    state = hf_state(SHAPE, torch.float32)  # trained in float32, published in bfloat16
    model = Weights(state)
    writer = writer_for(tmp_path / "checkpoints", model)
    writer.start(model, 1)
    writer.wait()
    buffers = {name: t.data_ptr() for name, t in (writer._buffers or {}).items()}
    with torch.no_grad():
        for tensor in model.buffers():
            tensor.mul_(-2.0)
    writer.start(model, 2)
    writer.wait()
    assert writer.buffer_allocations == 1
    assert {name: t.data_ptr() for name, t in (writer._buffers or {}).items()} == buffers
    live = model.to_hf(dict(model.named_buffers()))
    for step, sign in ((1, 1.0), (2, -2.0)):
        snapshot = written(tmp_path / "checkpoints" / f"step-{step}")
        assert snapshot.keys() == state.keys()
        for name, tensor in snapshot.items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, (state[name] * sign).to(torch.bfloat16)), (step, name)
    assert all(torch.equal(live[k], state[k] * -2.0) for k in state)


@pytest.mark.gpu
def test_on_a_gpu_the_copy_runs_on_a_side_stream_into_pinned_buffers(tmp_path: Path) -> None:
    """``start`` returns while the training stream is still busy (no device-wide sync), the
    buffers are pinned, allocated once, and the snapshot holds the weights of the moment the
    copy was queued, even when the optimizer changes them right after."""
    state = hf_state(SHAPE, torch.float32)
    model = Weights(state).cuda()
    writer = writer_for(tmp_path / "checkpoints", model)
    for step in (1, 2):
        torch.cuda._sleep(2_000_000_000)  # about a second of work queued on this stream
        writer.start(model, step)
        assert not torch.cuda.current_stream().query(), "start waited for the device"
        writer.before_weights_change()
        with torch.no_grad():
            for tensor in model.buffers():
                tensor.add_(1.0)  # the next step's update, ordered after the copy
        writer.wait()
    assert writer.buffer_allocations == 1
    assert all(b.is_pinned() for b in (writer._buffers or {}).values())
    for step in (1, 2):
        snapshot = written(tmp_path / "checkpoints" / f"step-{step}")
        for name, tensor in snapshot.items():
            expected = (state[name] + (step - 1)).to(torch.bfloat16)
            assert torch.equal(tensor, expected), (step, name)
