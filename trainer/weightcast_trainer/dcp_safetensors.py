"""DCP storage for snapshots: each rank streams its blocks into one fsynced safetensors file.

:class:`SafetensorsStorageWriter` is DCP's ``HuggingFaceStorageWriter`` with
``save_distributed=True`` (each rank writes ``shard-<rank+1>-model-00001-of-00001
.safetensors`` with its own blocks of rows; without it every rank would write the same file
name and overwrite the others), with two changes:

* ``write_data`` writes the file itself: the header (with DCP's ``DCP_SHARDING_INFO``, so the
  file reads back with ``HuggingFaceStorageReader``), then each tensor's bytes straight from
  the staged tensor, then fsync. The stock writer serializes the whole shard into memory
  twice first (``safetensors.torch.save`` -> bytes); this keeps the write at the staging
  buffers' memory. Before its bytes are written, every float tensor is checked for NaN and
  infinity (:class:`NonFiniteWeight`): a non-finite weight is never written.
* ``finish`` (on the coordinator, after every rank's write) records every data file and its
  size in :attr:`files`; the snapshot writer puts that list in ``weightcast.json``, the
  completion record the publisher checks (DCP's HF writer writes no ``.metadata``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from weightcast.contract.errors import WeightcastError
from weightcast.contract.snapshot_format import SHARDING_INFO_KEY, SnapshotFile, data_file_name
from weightcast.contract.tensorfile import encode_header, file_order, safetensors_dtype

DCP_VERSION = "1.0"
"""``__metadata__["DCP_VERSION"]`` as torch's HF writer sets it."""
_WRITE_BYTES = 64 * 1024 * 1024
"""Tensors are checked and written in slices this size (bounded extra memory)."""


class NonFiniteWeight(WeightcastError, ValueError):
    """A weight holds NaN or infinity; the message names it. Nothing of it was written.

    A :class:`WeightcastError`: the trainer stops with this one line (exit 1), not a
    traceback; the model itself diverged, and training on would publish nothing."""


class SafetensorsStorageWriter(HuggingFaceStorageWriter):
    """DCP storage writer of one snapshot directory; see the module docstring."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), save_distributed=True)
        self.files: list[SnapshotFile] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        shard_index = plan.storage_data["shard_index"]  # this rank's position, from 1
        tensors: dict[str, torch.Tensor] = {}
        offsets: dict[str, dict[str, list[int]]] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                raise ValueError(f"{item.index.fqn}: only tensors go into a snapshot")
            tensors[item.index.fqn] = planner.resolve_data(item).detach()
            offsets[item.index.fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
        results: list[WriteResult] = []
        if tensors:
            name = data_file_name(shard_index - 1)
            size = write_file(Path(self.path) / name, tensors, offsets)
            stored = SnapshotFile(name, size)
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=tensors[item.index.fqn].nbytes,
                    storage_data=stored,
                )
                for item in plan.items
            ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = {wr.storage_data for rank in results for wr in rank}
        self.files = sorted(files, key=lambda f: f.name)


def write_file(
    path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, dict[str, list[int]]]
) -> int:
    """Write ``tensors`` as one safetensors file and fsync it; its size in bytes.

    Raises :class:`NonFiniteWeight` before writing a tensor that holds NaN or infinity (the
    caller removes the unfinished directory).
    """
    dtypes = {name: safetensors_dtype(t.dtype) for name, t in tensors.items()}
    order = [name for name, _ in file_order(dtypes.items())]
    metadata = {
        SHARDING_INFO_KEY: json.dumps(offsets),
        "DCP_VERSION": DCP_VERSION,
        "format": "pt",
    }
    header = encode_header([(n, dtypes[n], tuple(tensors[n].shape)) for n in order], metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(header))
        for name in order:
            _write_tensor(fd, name, tensors[name])
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _write_tensor(fd: int, name: str, tensor: torch.Tensor) -> None:
    flat = tensor.reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    step = max(1, _WRITE_BYTES // max(1, flat.element_size()))
    for part in flat.split(step):
        if part.is_floating_point() and part.numel():
            values = part if part.element_size() > 1 else part.to(torch.float16)  # float8
            low, high = torch.aminmax(values)  # NaN propagates; an inf is the max or the min
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                raise NonFiniteWeight(f"{name} holds NaN or infinite values")
        if part.numel():
            _write_all(fd, memoryview(part.view(torch.uint8).numpy()))


def _write_all(fd: int, data: Any) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
