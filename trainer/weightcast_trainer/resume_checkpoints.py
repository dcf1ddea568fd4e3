"""Resume checkpoints and the acknowledgements they allow.

An entry is acknowledged only once a resume checkpoint holding its update is durable and
complete on every rank, and the train state in that checkpoint lists it, so a restart neither
loses nor repeats it. :class:`ResumeCheckpoints` owns that lifecycle; the loop tells it what
each step trained (:meth:`~ResumeCheckpoints.trained`) and when a checkpoint is due
(:meth:`~ResumeCheckpoints.save`), and calls :meth:`~ResumeCheckpoints.settle` once no rank
is still writing one. With ``async_mode = "async"`` the checkpoint is written in the
background while training goes on; its entries are acknowledged when every rank reports it
done.

A checkpoint that cannot be written (a full disk) leaves its entries unacknowledged for the
next one; at exit the last one is retried until it is written (:meth:`save_final`).
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from weightcast.contract.errors import WeightcastError
from weightcast.contract.heartbeat import Heartbeat
from weightcast.runtime.durable import remove_dir
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import Retries
from weightcast_trainer import collectives
from weightcast_trainer.resume import (
    IncompleteCheckpoint,
    TrainState,
    make_durable,
    newest_checkpoint,
    remove_partial,
)
from weightcast_trainer.telemetry import Telemetry

log = get_logger("trainer")

CHECKPOINT_ERRORS = (OSError, CheckpointException, IncompleteCheckpoint)
"""What a resume checkpoint that could not be written raises (DCP wraps each rank's error
in a CheckpointException, raised alike on every rank)."""

FINAL_RETRY_MAX_S = 30.0
"""Longest pause between tries of the last resume checkpoint at exit."""


class CheckpointNotWritten(WeightcastError):
    """The trainer stopped while its last resume checkpoint could still not be written."""


@dataclasses.dataclass
class InFlightCheckpoint:
    """A resume checkpoint being written and the entries it alone holds."""

    step: int
    entry_ids: list[str]
    future: Future[Any]
    started: float
    mark: int
    """The train state's mark to settle once this checkpoint is durable."""
    finished: float = 0.0

    def __post_init__(self) -> None:
        self.future.add_done_callback(lambda _: setattr(self, "finished", time.perf_counter()))


def load_newest(checkpointer: Any, train_state: TrainState, folder: Path, leader: bool) -> int:
    """Load the newest complete resume checkpoint, if any; its step (0 without one).

    Rank 0 first removes the unfinished ones a killed run left.
    """
    if leader:
        for name in remove_partial(folder):
            log.info("removed an unfinished resume checkpoint", name=name)
    collectives.barrier()
    found = newest_checkpoint(folder)
    if found is None:
        return 0
    step, path = found
    train_state.size_for(path)
    checkpointer.load(step=step)
    log.info("resumed", step=train_state.step, path=str(path), applied=len(train_state.applied))
    return train_state.step


class ResumeCheckpoints:
    """Writes resume checkpoints through torchtitan's checkpointer and acknowledges the
    entries each durable one holds.

    ``ack`` acknowledges entries on this rank; ``trim`` (rank 0 only, or None) trims what
    every rank acknowledged; ``needed_bytes`` estimates one checkpoint's size for the log of a
    failure. Every method is called by every rank at the same point.
    """

    def __init__(
        self,
        checkpointer: Any,
        train_state: TrainState,
        folder: Path,
        durable_step: int,
        *,
        asynchronous: bool,
        ack: Callable[[Sequence[str]], None],
        trim: Callable[[], int] | None,
        telemetry: Telemetry,
        needed_bytes: Callable[[], int],
        device: Any,
        leader: bool,
    ) -> None:
        self.checkpointer = checkpointer
        self.train_state = train_state
        self.folder = folder
        self.durable_step = durable_step
        """Step of the newest durable resume checkpoint (its entries are acknowledged)."""
        self.asynchronous = asynchronous
        self.ack = ack
        self.trim = trim
        self.telemetry = telemetry
        self.needed_bytes = needed_bytes
        self.device = device
        self.leader = leader
        self.to_ack: list[str] = []
        """Trained entries in no checkpoint started yet."""
        self.in_flight: InFlightCheckpoint | None = None
        self.failures = 0

    @property
    def saving(self) -> bool:
        """A checkpoint is still being written on this rank."""
        return self.in_flight is not None and not self.in_flight.future.done()

    def trained(self, entry_ids: Sequence[str]) -> None:
        """``entry_ids`` were applied by a step: the next checkpoint holds them."""
        self.to_ack += entry_ids

    def save(self) -> None:
        """Save a resume checkpoint; acknowledge what it holds once it is durable.

        A synchronous save is durable when ``save()`` returns. An asynchronous one takes the
        entries trained so far with it and is settled later (the loop sees it done on every
        rank, or the next checkpoint or the exit waits for it); entries trained meanwhile
        wait for the next checkpoint. DCP's staging copies every tensor before ``save()``
        returns, so the checkpoint holds this step's weights and applied ids. A save that
        fails leaves its entries for the next checkpoint.
        """
        self.settle()
        state = self.train_state
        if state.step == self.durable_step:
            self.ack(self.to_ack)
            self.to_ack = []
            return
        begin = time.perf_counter()
        entries, self.to_ack = self.to_ack, []
        mark = state.checkpointed()
        failed_at_once = False
        try:
            self.checkpointer.save(state.step)
            future = self.checkpointer.save_future or _done()
        except CHECKPOINT_ERRORS as exc:
            future, failed_at_once = _done(exc), True
        self.in_flight = InFlightCheckpoint(state.step, entries, future, begin, mark)
        settle_now = not self.asynchronous
        if not settle_now:  # settled at once on every rank if it failed at once on one
            (settle_now,) = collectives.max_over_ranks([float(failed_at_once)], self.device)
        if settle_now:
            self.settle()
        else:
            log.info(
                "resume checkpoint started",
                step=state.step,
                entries=len(entries),
                seconds=time.perf_counter() - begin,
            )

    def settle(self) -> None:
        """Wait for the checkpoint in flight, make it durable, acknowledge what it holds.

        Rank 0's save returns after DCP's ``.metadata``; the all-reduce after rank 0 checked
        and fsynced it means no rank acknowledges before the checkpoint is complete and
        durable, and that every rank knows whether it failed anywhere.
        """
        saving, self.in_flight = self.in_flight, None
        if saving is None:
            return
        error: BaseException | None = None
        try:
            saving.future.result()
            if self.leader:
                make_durable(self.folder / f"step-{saving.step}")
        except CHECKPOINT_ERRORS as exc:
            error = exc
        (failed,) = collectives.max_over_ranks([float(error is not None)], self.device)
        if failed:
            self.checkpointer.save_future = None  # torchtitan would re-raise it on next save
            self._failed(saving.step, error, saving.entry_ids)
            return
        # result() may return just before the done callback has run: then it is now.
        seconds = (saving.finished or time.perf_counter()) - saving.started
        self.durable_step = saving.step
        self.train_state.settled(saving.mark)
        self.ack(saving.entry_ids)
        collectives.barrier()  # rank 0 trims what every rank has just acknowledged
        trimmed = self.trim() if self.trim is not None else 0
        log.info(
            "resume checkpoint",
            step=saving.step,
            acked=len(saving.entry_ids),
            trimmed=trimmed,
            seconds=seconds,
            acked_after=time.perf_counter() - saving.started,
            mode="async" if self.asynchronous else "disabled",
        )
        self.telemetry.update(
            Heartbeat(
                checkpoint_step=saving.step, checkpoint_seconds=seconds, last_checkpoint_error=""
            )
        )

    def save_final(self, signals: Callable[[], int], report: Callable[[], None]) -> None:
        """Checkpoint what was trained, retrying with back-off while the save fails.

        A full disk at exit is waited out (each failure is logged); a signal that arrives
        meanwhile (``signals()`` grows) gives up, leaving the entries pending for the next run
        to train again. ``report`` refreshes the heartbeat between tries.
        """
        seen = signals()
        retries = Retries(first=1.0, cap=FINAL_RETRY_MAX_S)  # no budget: until a signal
        while True:
            self.save()
            self.settle()
            if self.train_state.step == self.durable_step:
                return
            (give_up,) = collectives.max_over_ranks([float(signals() > seen)], self.device)
            if give_up:
                raise CheckpointNotWritten(
                    f"stopped before a resume checkpoint of step {self.train_state.step} could "
                    f"be written to {self.folder}; the {len(self.to_ack)} entries trained "
                    f"since step {self.durable_step} stay pending and are trained again by the "
                    "next run"
                )
            pause = retries.failed()
            log.warning("retrying the last resume checkpoint", retry_in=pause)
            report()
            time.sleep(pause)

    def _failed(self, step: int, error: BaseException | None, entry_ids: list[str]) -> None:
        """Training goes on; the entries wait, unacknowledged, for the next checkpoint.

        Rank 0 removes what the failed save left (it frees the space, and torchtitan's
        retention must never count it and delete a complete checkpoint in its place). A full
        disk does not always say so (torch's writer reports a short write as "unexpected
        pos"), so the log compares the free space with what a checkpoint needs.
        """
        self.to_ack = entry_ids + self.to_ack
        self.failures += 1
        if self.leader:
            remove_dir(self.folder / f"step-{step}")
        collectives.barrier()
        text = _describe(error) if error is not None else "failed on another rank"
        needed = self.needed_bytes()
        free = shutil.disk_usage(self.folder).free
        full = free < needed or _disk_full(error)
        log.error(
            "resume checkpoint failed; training goes on, nothing is acknowledged until a "
            "later checkpoint is written" + (f" (free space in {self.folder})" if full else ""),
            step=step,
            error=text,
            resume_dir=str(self.folder),
            free_bytes=free,
            needed_bytes=needed,
            unacknowledged=len(self.to_ack),
            durable_step=self.durable_step,
        )
        self.telemetry.update(
            Heartbeat(
                checkpoint_failures=self.failures, last_checkpoint_error=f"step {step}: {text}"
            )
        )


def _describe(error: BaseException) -> str:
    """One line per failure: DCP's CheckpointException holds one exception per rank."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items()
        )
    return f"{type(error).__name__}: {error}"


def _disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or a rank's error inside it) says the filesystem is full."""
    found = list(error.failures.values()) if isinstance(error, CheckpointException) else []
    for exc in [error, *(exc for exc, _ in found)]:
        while exc is not None:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            exc = exc.__cause__ or exc.__context__
    return False


def _done(error: BaseException | None = None) -> Future[Any]:
    """A future already finished: what a synchronous save leaves to wait for."""
    future: Future[Any] = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future
