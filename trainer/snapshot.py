"""Model-only snapshots for the publisher: HF-keyed, publish dtype, DCP, renamed when whole."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from shared.durable import fsync_path, publish_dir, remove_dir, write_json
from shared.logs import get_logger
from shared.snapshots import CONFIG_NAME, TMP_PREFIX, SnapshotInfo, snapshot_name

log = get_logger("trainer.snapshot")


class SnapshotWriter:
    """Writes ``<checkpoint_dir>/step-<S>/`` from the live model.

    Every rank calls :meth:`write` (DCP save is collective: each rank writes its own shards);
    rank 0 prepares the temp directory, adds ``config.json`` and ``weightcast.json`` and
    renames it once all ranks are done.
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        to_hf: Any,
        hf_config: dict[str, Any],
        model_name: str,
        run_id: str,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.to_hf = to_hf
        self.hf_config = hf_config
        self.model_name = model_name
        self.run_id = run_id
        self.dtype = dtype

    def hf_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's weights under HF names in the publish dtype (tied lm_head dropped)."""
        state = self.to_hf(model.state_dict())
        if self.hf_config.get("tie_word_embeddings"):
            lm_head = state.pop("lm_head.weight", None)
            if lm_head is not None and not _same_storage(
                lm_head, state["model.embed_tokens.weight"]
            ):
                raise RuntimeError(
                    "the config ties lm_head to embed_tokens but the model holds "
                    "two different tensors; the snapshot would be wrong"
                )
        return {name: t.detach().to(self.dtype) for name, t in state.items()}

    def write(self, model: nn.Module, step: int) -> Path:
        final = self.checkpoint_dir / snapshot_name(step)
        tmp = self.checkpoint_dir / f"{TMP_PREFIX}{final.name}"
        leader = _rank() == 0
        start = time.perf_counter()
        if leader:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        dcp.save(self.hf_state_dict(model), storage_writer=dcp.FileSystemWriter(tmp))
        _barrier()
        if leader:
            write_json(tmp / CONFIG_NAME, self.hf_config)
            SnapshotInfo(
                snapshot_id=uuid.uuid4().hex,
                run_id=self.run_id,
                step=step,
                created_at=time.time(),
                dtype=str(self.dtype).removeprefix("torch."),
                model=self.model_name,
            ).write(tmp)
            fsync_path(tmp)
            if final.exists():
                log.warning("replacing an existing snapshot", path=str(final))
                remove_dir(final)
            publish_dir(tmp, final)
            log.info(
                "snapshot written", step=step, path=str(final), seconds=time.perf_counter() - start
            )
        _barrier()
        return final


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (a, b)]
    return local[0].data_ptr() == local[1].data_ptr()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
