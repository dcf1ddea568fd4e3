"""Trainer snapshots written as the trainer writes them, and what resume checkpoints hold."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    INFO_NAME,
    SnapshotFile,
    SnapshotInfo,
    snapshot_name,
)
from weightcast.runtime.durable import write_json
from weightcast_trainer.dcp_safetensors import SafetensorsStorageWriter
from weightcast_trainer.resume import (
    TrainState,
    newest_checkpoint,
    read_model_weights,
    read_train_state,
)

from helpers.files import REPO
from helpers.models import hf_state
from helpers.processes import torchrun

FORMATS = (FORMAT_DCP_SAFETENSORS, FORMAT_DCP_TORCH_SAVE)
"""Snapshot formats: what the trainer writes, and what earlier trainers wrote."""


def write_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor] | None = None,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """A complete snapshot as the trainer writes it (``dcp-safetensors/1``: the trainer's own
    storage writer) or as earlier trainers did (``dcp-torchsave``: DCP's FileSystemWriter)."""
    path = checkpoint_dir / snapshot_name(step)
    state = hf_state(shape, torch.bfloat16) if state is None else state
    files: tuple[SnapshotFile, ...] = ()
    if format == FORMAT_DCP_SAFETENSORS:
        path.mkdir(parents=True, exist_ok=True)
        storage = SafetensorsStorageWriter(path)
        dcp.save(state, storage_writer=storage, no_dist=True)
        files = tuple(storage.files)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return finish_snapshot(path, step, shape, format, files)


def finish_snapshot(
    path: Path, step: int, shape: ModelShape, format: str, files: tuple[SnapshotFile, ...]
) -> Path:
    """What the trainer writes once the tensors are saved: ``config.json``, then the info
    file that makes the snapshot complete."""
    (path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    info = SnapshotInfo(
        uuid.uuid4().hex, "test-run", step, time.time(), "bfloat16", "test", format, files
    )
    write_json(path / INFO_NAME, info.to_json())
    return path


def final_train_state(resume_dir: Path) -> TrainState:
    """The train state of the newest complete resume checkpoint."""
    found = newest_checkpoint(resume_dir)
    assert found is not None, f"no complete resume checkpoint in {resume_dir}"
    return read_train_state(found[1])


def checkpoint_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a resume checkpoint (no optimizer, schedule or train state)."""
    return read_model_weights(checkpoint)


_SHARDED_SAVE = """
import dataclasses, json, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pathlib import Path
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from weightcast_trainer.dcp_safetensors import SafetensorsStorageWriter

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in load_file(sys.argv[1]).items()}
if sys.argv[3] == "dcp-torchsave":
    dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[2]))
else:
    storage = SafetensorsStorageWriter(Path(sys.argv[2]))
    dcp.save(state, storage_writer=storage)
    if dist.get_rank() == 0:
        files = [dataclasses.asdict(f) for f in storage.files]
        (Path(sys.argv[2]) / "files.json").write_text(json.dumps(files))
dist.barrier()
dist.destroy_process_group()
"""


def write_sharded_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor],
    ranks: int,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """A snapshot written by ``ranks`` gloo processes, every tensor sharded along dim 0 (FSDP),
    in either format."""
    path = checkpoint_dir / snapshot_name(step)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    source = checkpoint_dir / f"state-{step}.safetensors"
    save_file(state, str(source))
    result = subprocess.run(
        torchrun(
            ranks,
            "--no-python",
            sys.executable,
            "-c",
            _SHARDED_SAVE,
            str(source),
            str(path),
            format,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    source.unlink()
    files: tuple[SnapshotFile, ...] = ()
    if format == FORMAT_DCP_SAFETENSORS:
        listing = path / "files.json"
        files = tuple(SnapshotFile(**f) for f in json.loads(listing.read_text()))
        listing.unlink()
    return finish_snapshot(path, step, shape, format, files)
