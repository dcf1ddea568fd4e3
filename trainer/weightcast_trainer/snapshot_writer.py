"""Model-only snapshots for the publisher: HF-keyed, publish dtype, DCP, renamed when whole.

Writing must not stall training: :meth:`SnapshotWriter.start` only copies the weights off
the device into host buffers it allocates once and reuses, then a background thread writes
them with DCP over a gloo group of its own, in the ``dcp-safetensors/1`` format
(:mod:`weightcast.contract.snapshot_format`, :mod:`weightcast_trainer.dcp_safetensors`). At most
one write is in flight; the training loop asks :meth:`busy` (agreed across ranks) and skips a
publish rather than queue it.

On a GPU the cast to the publish dtype and the device-to-host copy run on a side stream into
buffers pinned in place (``cudaHostRegister``: exactly their size, where the caching pinned
allocator would round each up to a power of two), and an event marks their end: the next
step's forward and backward overlap the copy, only the optimizer step waits for it
(:meth:`SnapshotWriter.before_weights_change`), and nothing waits for the whole device.

A write never leaves a partial ``step-<S>/``: everything goes to ``.tmp-step-<S>/`` first.
A step written again (after a restart) replaces the old ``step-<S>/`` in one atomic swap
where the filesystem has ``RENAME_EXCHANGE`` (:func:`~weightcast.runtime.durable.replace_dir`).
When the checkpoint filesystem is full, the snapshot is skipped, counted
(:attr:`SnapshotWriter.skipped_no_space`) and logged, and training goes on. A weight that
holds NaN or infinity is never written: the write fails and :meth:`busy` raises, naming it.
"""

from __future__ import annotations

import errno
import shutil
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.cuda._pin_memory_utils as pin_memory_utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from weightcast.contract.snapshot_format import (
    CONFIG_NAME,
    FORMAT_DCP_SAFETENSORS,
    INFO_NAME,
    TMP_PREFIX,
    SnapshotFile,
    SnapshotInfo,
    snapshot_name,
)
from weightcast.runtime.durable import (
    fsync_path,
    publish_dir,
    remove_dir,
    replace_dir,
    sweep,
    write_json,
)
from weightcast.runtime.logs import get_logger
from weightcast_trainer.dcp_safetensors import NonFiniteWeight, SafetensorsStorageWriter

log = get_logger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# How a write ended, agreed across ranks (the most severe wins).
_WRITTEN, _NO_SPACE, _FAILED, _NON_FINITE = 0, 1, 2, 3


class SnapshotWriter:
    """Writes ``<checkpoint_dir>/step-<S>/`` from the live model, in the background.

    Every rank stages and writes its own shards (DCP save is collective); rank 0 adds
    ``config.json`` and ``weightcast.json`` (listing every rank's file) once ``dcp.save``
    returned, which it does only after every rank's data, and renames ``.tmp-step-<S>/`` to
    ``step-<S>/``. Counters: :attr:`written`, :attr:`skipped_no_space`.
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
        self.skipped_no_space = 0
        self.stage_seconds = 0.0
        self.write_seconds = 0.0
        self._buffers: dict[str, Any] | None = None
        self.buffer_allocations = 0
        """How many times the host buffers were allocated: once per writer."""
        self._stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None
        """Recorded on the side stream after the last staged copy (GPU weights only)."""
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
            if isinstance(error, NonFiniteWeight):  # a diverged model: one line, no traceback
                raise error
            raise RuntimeError(f"the background snapshot write failed: {error}") from error
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

    def before_weights_change(self) -> None:
        """Make the current stream wait for a staged copy still reading the weights: call it
        before the optimizer step changes them. Nothing to wait for off the GPU."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)

    def _stage(self, live: dict[str, torch.Tensor]) -> dict[str, Any]:
        on_gpu = any(_local(t).is_cuda for t in live.values())
        if self._buffers is None:
            self._buffers = {
                name: _host_buffer(t, self.dtype, pinned=on_gpu) for name, t in live.items()
            }
            self.buffer_allocations += 1
        if on_gpu:
            self._copied = self._copy_on_side_stream(live)
        else:
            for name, source in live.items():
                _local(self._buffers[name]).copy_(_local(source).detach())
        return self._buffers

    def _copy_on_side_stream(self, live: dict[str, torch.Tensor]) -> torch.cuda.Event:
        """Cast and copy every weight to its pinned buffer on a side stream, without
        waiting; the event that marks the end of the copies."""
        assert self._buffers is not None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())  # the weights as the step left them
        with torch.cuda.stream(stream):
            for name, source in live.items():
                local = _local(source).detach()
                local.record_stream(stream)  # not reused while this stream reads it
                _local(self._buffers[name]).copy_(local.to(self.dtype), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return copied

    def _write(self, state: dict[str, Any], step: int) -> None:
        try:
            if self._copied is not None:
                self._copied.synchronize()  # this thread waits, not the training loop
            begin = time.perf_counter()
            final = self.checkpoint_dir / snapshot_name(step)
            tmp = self.checkpoint_dir / f"{TMP_PREFIX}{final.name}"
            failure = self._save(state, tmp, final, step)
            outcome = self._agree(_classify(failure))
            if outcome != _WRITTEN and self.leader:
                remove_dir(tmp)  # a step-<S>/ is whole or absent
            if outcome == _NO_SPACE:
                self.skipped_no_space += 1
                log.warning(
                    "snapshot skipped: no space left in the checkpoint directory",
                    step=step,
                    path=str(self.checkpoint_dir),
                    free_bytes=_free_bytes(self.checkpoint_dir),
                    skipped_no_space=self.skipped_no_space,
                )
                return
            if outcome == _NON_FINITE:
                raise _non_finite(failure, step)
            if outcome == _FAILED:
                raise failure or RuntimeError(f"step {step}: the snapshot failed on another rank")
            self.write_seconds = time.perf_counter() - begin
            self.written += 1
            self.last_path, self.last_step = str(final), step
            log.info("snapshot written", step=step, path=str(final), seconds=self.write_seconds)
        except BaseException as exc:  # surfaced to the training loop by busy()/wait()
            self._error = exc

    def _save(
        self, state: dict[str, Any], tmp: Path, final: Path, step: int
    ) -> BaseException | None:
        """Write the snapshot; the failure (this rank's view of it), None when written."""
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            storage = SafetensorsStorageWriter(tmp)
            dcp.save(state, storage_writer=storage, process_group=self.group)
            if self.leader:
                self._finish(tmp, final, step, storage.files)
        except (CheckpointException, OSError) as exc:
            return exc
        return None

    def _agree(self, outcome: int) -> int:
        """The most severe outcome over all ranks (they must all take the same path)."""
        if self.group is None:
            return outcome
        flag = torch.tensor([outcome])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def _finish(self, tmp: Path, final: Path, step: int, files: list[SnapshotFile]) -> None:
        """Rank 0, after every rank's data: the config, the completion record, the rename."""
        write_json(tmp / CONFIG_NAME, self.hf_config)
        info = SnapshotInfo(
            snapshot_id=uuid.uuid4().hex,
            run_id=self.run_id,
            step=step,
            created_at=time.time(),
            dtype=str(self.dtype).removeprefix("torch."),
            model=self.model_name,
            format=FORMAT_DCP_SAFETENSORS,
            files=tuple(files),
        )
        write_json(tmp / INFO_NAME, info.to_json())
        fsync_path(tmp)
        if not final.exists():
            publish_dir(tmp, final)
            return
        # A rerun of this step after a restart: swap the new one in (the publisher may be
        # reading step-<S>/ right now), then delete the old one.
        atomic = replace_dir(tmp, final)
        log.warning("replaced an existing snapshot", path=str(final), atomic=atomic)


def _causes(failure: BaseException | None) -> list[BaseException]:
    """The exceptions behind a failed write (every rank's, for a failed ``dcp.save``)."""
    if isinstance(failure, CheckpointException):
        return [exc for exc, _ in failure.failures.values()]
    return [] if failure is None else [failure]


def _classify(failure: BaseException | None) -> int:
    causes = _causes(failure)
    if any(isinstance(c, NonFiniteWeight) for c in causes):
        return _NON_FINITE
    if any(isinstance(c, OSError) and c.errno in NO_SPACE for c in causes):
        return _NO_SPACE
    return _FAILED if causes else _WRITTEN


def _non_finite(failure: BaseException | None, step: int) -> NonFiniteWeight:
    found = [str(c) for c in _causes(failure) if isinstance(c, NonFiniteWeight)]
    what = found[0] if found else "another rank holds a non-finite weight"
    return NonFiniteWeight(
        f"step {step}: {what}; the snapshot was not written (no step-{step}/ exists). The model "
        "diverged: resume from an earlier resume checkpoint with a lower learning rate"
    )


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def _host_buffer(source: torch.Tensor, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """A host tensor for ``source``'s local shard in ``dtype``, pinned in place when asked
    (exactly its size, unpinned when it is freed); a DTensor like ``source`` around it."""
    local = _local(source)
    buffer = torch.empty(local.shape, dtype=dtype, device="cpu")
    if pinned and buffer.numel():
        pin_memory_utils.pin_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        weakref.finalize(buffer, pin_memory_utils.unpin_memory, buffer.data_ptr())
    if not isinstance(source, DTensor):
        return buffer
    meta = TensorMeta(source.shape, source.stride(), dtype)
    return DTensor(
        buffer, DTensorSpec(source.device_mesh, source.placements, meta), requires_grad=False
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _local(a).data_ptr() == _local(b).data_ptr()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
