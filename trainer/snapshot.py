"""Model-only snapshots for the publisher: HF-keyed, publish dtype, DCP, renamed when whole.

Writing must not stall training: :meth:`SnapshotWriter.start` only copies the weights off
the device into host buffers it reuses (pinned on a GPU), then a background thread writes
them with DCP over a gloo group of its own. At most one write is in flight; the training
loop asks :meth:`busy` (agreed across ranks) and skips a publish rather than queue it.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from weightcast.contract.durable import fsync_path, publish_dir, remove_dir, sweep, write_json
from weightcast.contract.snapshots import CONFIG_NAME, TMP_PREFIX, SnapshotInfo, snapshot_name
from weightcast.runtime.logs import get_logger

log = get_logger(__name__)


class SnapshotWriter:
    """Writes ``<checkpoint_dir>/step-<S>/`` from the live model, in the background.

    Every rank stages and writes its own shards (DCP save is collective); rank 0 adds
    ``config.json`` and ``weightcast.json`` once DCP's ``.metadata`` is written, which DCP
    does only after every rank's data, and renames ``.tmp-step-<S>/`` to ``step-<S>/``.
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
        self.leader = _rank() == 0
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.last_path = ""
        self.last_step = -1
        self.written = 0
        self.stage_seconds = 0.0
        self.write_seconds = 0.0
        self._buffers: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if self.leader:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            for name in sweep(self.checkpoint_dir, (f"{TMP_PREFIX}step-",)):
                log.info("removed an unfinished snapshot", name=name)

    def hf_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's live weights under HF names (tied lm_head dropped), not copied."""
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
        return state

    def busy(self) -> bool:
        """True while this rank's previous write runs; raises if that write failed."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the background snapshot write failed") from error
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.busy()

    @torch.no_grad()
    def start(self, model: nn.Module, step: int) -> None:
        """Copy the weights to host buffers, then write them in a background thread.

        The caller makes sure no write is in flight on any rank (the buffers are reused).
        """
        begin = time.perf_counter()
        staged = self._stage(self.hf_state_dict(model))
        self.stage_seconds = time.perf_counter() - begin
        self._thread = threading.Thread(
            target=self._write, args=(staged, step), name="weightcast-snapshot", daemon=True
        )
        self._thread.start()

    def _stage(self, live: dict[str, torch.Tensor]) -> dict[str, Any]:
        if self._buffers is None:
            cast = {name: t.detach().to(self.dtype) for name, t in live.items()}
            self._buffers = _create_cpu_state_dict(cast, pin_memory=torch.cuda.is_available())
        for name, source in live.items():
            _local(self._buffers[name]).copy_(_local(source).detach(), non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return self._buffers

    def _write(self, state: dict[str, Any], step: int) -> None:
        try:
            begin = time.perf_counter()
            final = self.checkpoint_dir / snapshot_name(step)
            tmp = self.checkpoint_dir / f"{TMP_PREFIX}{final.name}"
            tmp.mkdir(parents=True, exist_ok=True)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=self.group)
            if self.leader:
                self._finish(tmp, final, step)
            self.write_seconds = time.perf_counter() - begin
            self.written += 1
            self.last_path, self.last_step = str(final), step
            log.info("snapshot written", step=step, path=str(final), seconds=self.write_seconds)
        except BaseException as exc:  # surfaced to the training loop by busy()/wait()
            self._error = exc

    def _finish(self, tmp: Path, final: Path, step: int) -> None:
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


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _local(a).data_ptr() == _local(b).data_ptr()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
