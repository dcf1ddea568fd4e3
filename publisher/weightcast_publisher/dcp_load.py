"""The fallback source: a snapshot's tensors loaded whole with ``dcp.load``.

Used for ``dcp-torchsave`` snapshots (``__<rank>_<i>.distcp`` files and DCP's pickled
``.metadata``, written by earlier trainers), for blocks that are not whole rows, and for
``--reader dcp-load``. It holds the whole model in memory, and it is the only part of the
publish path that imports torch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from weightcast.contract.plan import PlannedFile
from weightcast.contract.regions import ColumnRange, Region
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS
from weightcast.contract.tensorfile import TensorSpan, safetensors_dtype
from weightcast_publisher.safetensors_writer import Piece
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot


class MemorySource:
    """The snapshot's tensors in memory; pieces are views of their bytes."""

    kind = "dcp-load"

    def __init__(self, snapshot: Snapshot) -> None:
        self.loaded = load_tensors(snapshot)
        try:
            self.tensors = {
                name: (safetensors_dtype(t.dtype), tuple(t.shape))
                for name, t in self.loaded.items()
            }
        except ValueError as exc:
            raise CorruptSnapshot(str(exc)) from None

    def pieces(self, region: Region) -> list[Piece]:
        tensor = self.loaded[region.source]
        if isinstance(region, ColumnRange):
            return [_bytes_of(tensor[:, region.start : region.stop])]
        if tensor.dim() == 0:
            return [_bytes_of(tensor)]
        return [_bytes_of(tensor[region.start : region.stop])]

    def whole_file(self, planned: PlannedFile) -> tuple[Any, tuple[TensorSpan, ...]] | None:
        return None


def load_tensors(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """All tensors of the snapshot as full CPU tensors, however many ranks wrote it."""
    if snapshot.info.format == FORMAT_DCP_SAFETENSORS:
        reader: Any = dcp.HuggingFaceStorageReader(str(snapshot.path))
    else:
        reader = dcp.FileSystemReader(snapshot.path)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # DCP raises assorted errors on a damaged .metadata or header
        raise CorruptSnapshot(
            f"{'.metadata' if snapshot.info.format != FORMAT_DCP_SAFETENSORS else 'header'} "
            f"unreadable: {type(exc).__name__}: {exc}"
        ) from None
    _check_sizes(snapshot, metadata)
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # truncated or missing data: assorted errors
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        raise CorruptSnapshot(f"tensor data unreadable: {last[0]}") from None
    return state


def _check_sizes(snapshot: Snapshot, metadata: Metadata) -> None:
    """A clear error for a ``.distcp`` file shorter than ``.metadata`` says."""
    if snapshot.info.format == FORMAT_DCP_SAFETENSORS:
        return  # the completeness check compared every file with weightcast.json
    sizes: dict[str, int] = {}
    for key, info in (metadata.storage_data or {}).items():
        path = snapshot.path / info.relative_path
        if info.relative_path not in sizes:
            try:
                sizes[info.relative_path] = path.stat().st_size
            except OSError as exc:
                raise CorruptSnapshot(f"data file unreadable: {exc}") from None
        if info.offset + info.length > sizes[info.relative_path]:
            raise CorruptSnapshot(
                f"{info.relative_path} is truncated: {key.fqn} needs bytes up to "
                f"{info.offset + info.length}, the file has {sizes[info.relative_path]}"
            )


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    if math.prod(flat.shape) == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())
