"""The training loop: read micro-batches, step, checkpoint, acknowledge, snapshot every K.

``Trainer`` is torchtitan's ForgeEngine (model, parallelism, optimizer, LR schedule, resume
checkpointer) plus the pieces weightcast adds: a Redis batch source, a policy loss, the train
state of applied stream ids, a background snapshot writer and telemetry.

What can go wrong, and what the loop does (docs/trainer.md has the whole story):

- a step whose loss or gradient norm is not finite is not applied; the batches at fault are
  dead-lettered and training goes on;
- the process dies or raises inside a step: the batches of that step each get a failed
  attempt, train alone when retried, and are dead-lettered after ``max_attempts``;
- Redis is unreachable: every call is retried with capped exponential back-off for
  ``redis_retry_seconds``, ``/healthz`` says 503 meanwhile;
- a resume checkpoint cannot be written (a full disk): its entries stay unacknowledged and
  the next checkpoint retries; at exit the last one is retried until it is written.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import shutil
import signal
import socket
import time
import uuid
import warnings
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.distributed import utils as dist_utils
from torchtitan.experiments.forge.engine import ForgeEngine

from weightcast.contract.codec import BatchLimits, RolloutBatch
from weightcast.contract.durable import remove_dir
from weightcast.contract.errors import ConfigError, WeightcastError
from weightcast.contract.keys import Keys
from weightcast.contract.streams import trim_acknowledged
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.redis_client import REPLY_TIMEOUT_S, redis_client
from weightcast.runtime.retry import Outage
from weightcast.trainer.batch_source import BatchSource, SourceSettings, StreamBatch
from weightcast.trainer.job import build_job_config
from weightcast.trainer.loss import (
    LossFn,
    LossSettings,
    get_loss,
    policy_entropy,
    trained_tokens,
)
from weightcast.trainer.model import flavor_args, hf_config, register_train_spec
from weightcast.trainer.resume import (
    IncompleteCheckpoint,
    TrainState,
    encode_ids,
    make_durable,
    newest_checkpoint,
    remove_partial,
    resume_dir,
)
from weightcast.trainer.snapshot import SnapshotWriter
from weightcast.trainer.step_plan import StepPlan, decide, local_view
from weightcast.trainer.telemetry import Telemetry

log = get_logger("trainer")

STEP_METRICS = ("loss", "kl", "entropy", "clip_fraction")
"""Per-step figures averaged over the trained tokens of all micro-batches and ranks."""

CHECKPOINT_ERRORS = (OSError, CheckpointException, IncompleteCheckpoint)
"""What a resume checkpoint that could not be written raises (DCP wraps each rank's error
in a CheckpointException, raised alike on every rank)."""

FINAL_RETRY_MAX_S = 30.0
"""Longest pause between tries of the last resume checkpoint at exit."""

_CPU_NOISE = (
    "DTensor random operators may not have complete support on cpu",
    "DTensor manual_seed\\(\\) may not have complete support on cpu",
    "In CPU autocast, but the target dtype is not supported",
)
"""torchtitan's warnings on every CPU start; they say nothing the user can act on."""


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


@dataclasses.dataclass
class StepOutcome:
    """What one optimizer step computed, and whether its update was applied."""

    metrics: dict[str, float]
    applied: bool
    finite: list[bool]
    """Per micro-batch of this rank: was its loss finite."""
    loss_failed_somewhere: bool
    """Some micro-batch on some rank had a non-finite loss."""


class Trainer(ForgeEngine):
    """torchtitan's engine driven by rollout batches from Redis.

    One optimizer step takes ``micro_batches`` stream entries on every DP rank. An entry is
    acknowledged only once a resume checkpoint holding its update is durable and complete on
    every rank, and the train state in that checkpoint lists it, so a restart neither loses
    nor repeats it. With ``async_mode = "async"`` the checkpoint is written in the background
    while training goes on; its entries are acknowledged when every rank reports it done.
    """

    def __init__(self, config: Config) -> None:
        self.cfg = config.trainer
        self.loss = _load_loss(self.cfg.loss)
        self.loss_settings = LossSettings(
            clip_eps=self.cfg.clip_eps, kl_coef=self.cfg.kl_coef, dual_clip=self.cfg.dual_clip
        )
        self.resume_dir = resume_dir(config)
        self.train_state = TrainState(self.cfg.applied_history)
        _quiet_cpu_warnings()
        _default_dist_env()
        register_train_spec()
        job = build_job_config(self.cfg, self.resume_dir, config.common.redis_retry_seconds)
        super().__init__(job)  # torchtitan: process group, model, optimizer, LR, checkpointer
        self._require_data_parallel_only()
        self.leader = torch.distributed.get_rank() == 0
        self.world = torch.distributed.get_world_size()
        self._take_over_checkpoint_cadence()
        self.durable_step = self._resume()
        self.run_id = self.cfg.run_id or self.train_state.run_id or self._new_run_id()
        self.train_state.run_id = self.run_id
        self.consumer = self._consumer_name()
        self.keys = Keys(config.common.namespace)
        self.outage = Outage(budget=config.common.redis_retry_seconds)
        self.redis = redis_client(
            config.common.redis_url, REPLY_TIMEOUT_S + self.cfg.block_ms / 1000
        )
        self.batches = self._open_batch_source()
        self.snapshots = self._snapshot_writer(config)
        self.telemetry = Telemetry(
            self.redis, self.keys, self.cfg.metrics_port, self.leader, self.outage
        )
        self._start_loop_state()
        self.telemetry.update(
            step=self.train_state.step,
            run_id=self.run_id,
            consumer=self.cfg.consumer or socket.gethostname(),
            last_snapshot="",
            world_size=self.world,
            last_checkpoint_error="",
        )

    # -- construction, in the order __init__ runs it --------------------------------------

    def _require_data_parallel_only(self) -> None:
        dims = self.parallel_dims
        if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled:
            raise ConfigError(
                "only data parallelism (FSDP) is supported: every rank reads its own batches"
            )

    def _take_over_checkpoint_cadence(self) -> None:
        """Resume checkpoints are due when weightcast says (acks wait for them), so
        torchtitan's checkpointer saves whenever asked; it saves no dataloader (Redis is
        the data)."""
        self.resume_every = self.checkpointer.interval
        self.checkpointer.interval = 1
        self.checkpointer.states.pop("dataloader", None)

    def _resume(self) -> int:
        """Load the newest complete resume checkpoint, if any; its step (0 without one)."""
        if self.leader:
            for name in remove_partial(self.resume_dir):
                log.info("removed an unfinished resume checkpoint", name=name)
        _barrier()
        found = newest_checkpoint(self.resume_dir)
        if found is None:
            return 0
        step, path = found
        self.train_state.size_for(path)
        self.checkpointer.load(step=step)
        log.info(
            "resumed",
            step=self.train_state.step,
            path=str(path),
            applied=len(self.train_state.applied),
        )
        return self.train_state.step

    def _new_run_id(self) -> str:
        """A fresh run id, rank 0's on every rank (sent as a tensor, not pickled)."""
        token = torch.tensor(list(uuid.uuid4().bytes[:6]), dtype=torch.uint8, device=self.device)
        if self.world > 1:
            torch.distributed.broadcast(token, src=0)
        return bytes(token.tolist()).hex()

    def _consumer_name(self) -> str:
        """The configured name (or the host name), with ``-dp<R>`` per rank under FSDP."""
        name = self.cfg.consumer or socket.gethostname()
        return f"{name}-dp{self.dp_rank}" if self.dp_degree > 1 else name

    def _open_batch_source(self) -> BatchSource:
        """Connect to the stream, count a step the last run left unfinished, queue this
        consumer's pending entries and acknowledge those the loaded checkpoint holds."""
        cfg = self.cfg
        source = BatchSource(
            self.redis,
            self.keys,
            self.consumer,
            BatchLimits(vocab_size=flavor_args(cfg.model).vocab_size, max_seq_len=cfg.seq_len),
            SourceSettings(
                block_ms=cfg.block_ms,
                max_attempts=cfg.max_attempts,
                dead_letters_kept=cfg.dead_letters_kept,
                claim_idle_ms=int(cfg.claim_idle_s * 1000),
                max_policy_lag=cfg.max_policy_lag,
            ),
            self.outage,
        )
        source.recover(self.train_state.applied_set)
        source.ack([])  # what the loaded checkpoint holds is durable already
        return source

    def _snapshot_writer(self, config: Config) -> SnapshotWriter:
        adapter = self.train_spec.state_dict_adapter(self.model_args, None)
        return SnapshotWriter(
            config.common.checkpoint_dir,
            adapter.to_hf,
            hf_config(flavor_args(self.cfg.model)),
            self.cfg.model,
            self.run_id,
        )

    def _start_loop_state(self) -> None:
        self.buffer: list[StreamBatch] = []
        self.to_ack: list[str] = []  # trained, in no checkpoint started yet
        self.in_flight: InFlightCheckpoint | None = None
        self.stop_signals = 0
        self.publish_skipped = 0
        self.skipped_steps = 0
        self.checkpoint_failures = 0
        self.trims_stream = self.cfg.trim_stream and self.leader  # one rank trims for all

    @property
    def stop_requested(self) -> bool:
        return self.stop_signals > 0

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Train until ``steps`` are in the train state or SIGTERM/SIGINT asks to stop.

        Every rank takes the same decisions: one all-reduce each round says whether to stop,
        whether an asynchronous resume checkpoint is still being written anywhere, and which
        batches the next step trains on each rank (:mod:`weightcast.trainer.step_plan`).
        """
        self._install_signal_handlers()
        steps = self.cfg.steps
        log.info(
            "trainer started",
            run_id=self.run_id,
            consumer=self.consumer,
            model=self.cfg.model,
            step=self.train_state.step,
            steps=steps or "unbounded",
            micro_batches=self.cfg.micro_batches,
            publish_every=self.cfg.publish_every,
            resume_every=self.resume_every,
            world_size=self.world,
            device=str(self.device),
        )
        self._report(force=True)
        while not (steps and self.train_state.step >= steps):
            self._fill()
            plan = self._plan()
            if self.in_flight is not None and not plan.saving:
                self._settle()  # done on every rank: nothing to wait for
            if plan.stop:
                break
            if not plan.passes:
                self._report()
                continue
            self._step(plan)
        self._finish()

    def _fill(self) -> None:
        """Read until this rank holds its micro-batches or one wait came back empty."""
        while len(self.buffer) < self.cfg.micro_batches and not self.stop_requested:
            item = self.batches.poll()
            if item is None:
                return
            self.buffer.append(item)

    def _plan(self) -> StepPlan:
        """This round's decisions, the same on every rank."""
        rank = torch.distributed.get_rank()
        saving = self.in_flight is not None and not self.in_flight.future.done()
        attempts = [item.attempts for item in self.buffer]
        local = local_view(
            attempts, self.cfg.micro_batches, rank, self.world, self.stop_requested, saving
        )
        return decide(self._max_over_ranks(local), local, rank)

    def _step(self, plan: StepPlan) -> None:
        """Train one step; apply it, or drop it when it is not finite; then checkpoint and
        start a snapshot when due.

        The step's entries are recorded in Redis while it runs, so that a death inside it
        counts a failed attempt for each. ``step_seconds`` covers all of it (a snapshot costs
        the loop its staging copy), so the heartbeat's ``tokens_per_s`` is what training
        really sustains.
        """
        start = time.perf_counter()
        items, self.buffer = self.buffer[: plan.take], self.buffer[plan.take :]
        self.batches.begin_step([item.entry_id for item in items])
        outcome = self.train_step([item.batch for item in items], plan.passes)
        if not outcome.applied:
            self.batches.end_step()  # finished: the batches at fault are dead-lettered now
            self._drop(items, outcome)
            self._report(force=True)
            return
        state = self.train_state
        state.record(self._gather_ids([item.entry_id for item in items]))
        state.step += 1
        self.to_ack += [item.entry_id for item in items]
        self.batches.end_step()
        if state.step != self.cfg.steps:  # the last step's are written by _finish
            if state.step % self.resume_every == 0:
                self._checkpoint()
            if state.step % self.cfg.publish_every == 0:
                self._publish()
        seconds = time.perf_counter() - start
        metrics = outcome.metrics
        oldest = min((item.batch.policy_version for item in items), default=None)
        lag = self.batches.policy_lag(oldest) if oldest is not None else None
        tokens = metrics.pop("tokens")
        self.telemetry.update(
            step=state.step,
            **metrics,
            tokens_per_s=tokens / seconds,
            step_seconds=seconds,
            **({"last_policy_lag": lag} if lag is not None else {}),
        )
        log.info(
            "step",
            step=state.step,
            **metrics,
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=tokens / seconds,
            policy_lag=lag,
            policy_versions=",".join(str(item.batch.policy_version) for item in items),
            entries=",".join(item.entry_id for item in items),
        )
        self._report(force=True)

    def train_step(self, batches: list[RolloutBatch], passes: int) -> StepOutcome:
        """One optimizer step over this rank's micro-batches, in ``passes`` forward/backward
        passes (the ones beyond ``batches`` on no batch, with zero weight).

        Each micro-batch's loss (a mean over its trained tokens) is weighted by its share of
        the trained tokens of the whole step on all ranks, so the update is the one a single
        batch holding every sequence would give. The update is applied only when every loss
        on every rank and the gradient norm are finite; otherwise the gradients are dropped
        and the weights, optimizer state and LR schedule stay as they were.
        """
        self.optimizers.zero_grad()
        model = self.model_parts[0]
        tokens = [trained_tokens(b) for b in batches]
        total = self._all_reduce(torch.tensor([float(sum(tokens))]))[0].item()
        sums = torch.zeros(2 * len(STEP_METRICS) + 2)  # metric sums, tokens, failed losses
        finite = []
        for index in range(passes):
            if index >= len(batches):
                self._idle_pass(model)
                continue
            batch = _to_device(batches[index], self.device)
            with self.train_context(None), self.maybe_enable_amp:
                logits = model(batch.input_ids)
                result = self.loss(logits, batch, self.loss_settings)
            values = {
                **result.metrics,
                "loss": result.loss.item(),
                "entropy": policy_entropy(logits, batch).item(),
            }
            del logits
            (result.loss * (tokens[index] * self.dp_degree / total)).backward()
            finite.append(math.isfinite(values["loss"]))
            if finite[-1]:
                for i, name in enumerate(STEP_METRICS):
                    if name in values:
                        sums[2 * i] += values[name] * tokens[index]
                        sums[2 * i + 1] += tokens[index]
            else:
                sums[-1] += 1
            sums[-2] += batch.num_tokens
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
        ).item()
        sums = self._all_reduce(sums)
        metrics = {
            name: (sums[2 * i] / sums[2 * i + 1]).item()
            for i, name in enumerate(STEP_METRICS)
            if sums[2 * i + 1] > 0
        }
        loss_failed = bool(sums[-1] > 0)
        metrics |= {"grad_norm": grad_norm, "tokens": sums[-2].item()}
        if loss_failed or not math.isfinite(grad_norm):
            self.optimizers.zero_grad()
            return StepOutcome(metrics, False, finite, loss_failed)
        metrics["lr"] = self.lr_schedulers.schedulers[0].get_last_lr()[0]  # this step's rate
        self.optimizers.step()
        self.lr_schedulers.step()
        return StepOutcome(metrics, True, finite, loss_failed)

    def _idle_pass(self, model: torch.nn.Module) -> None:
        """A forward and backward pass that adds nothing to the gradients: FSDP's collectives
        need every rank to run as many passes as the busiest one."""
        tokens = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        with self.train_context(None), self.maybe_enable_amp:
            logits = model(tokens)
        (logits.float().sum() * 0.0).backward()

    def _drop(self, items: list[StreamBatch], outcome: StepOutcome) -> None:
        """A step that was not applied: dead-letter the batches at fault, keep the others.

        The batches whose loss was not finite are at fault. When every loss was finite and
        only the gradient norm was not, the step cannot tell which batch caused it, and all
        of its batches are dead-lettered. Every rank decides alike (the flags were reduced).
        """
        self.skipped_steps += 1
        step = self.train_state.step + 1
        grad_norm = outcome.metrics["grad_norm"]
        if outcome.loss_failed_somewhere:
            at_fault = [item for item, ok in zip(items, outcome.finite, strict=True) if not ok]
            reason = (
                f"its loss was not finite in step {step}; the step was not applied "
                "(check the batch's advantages and log-probabilities, or the loss function)"
            )
        else:
            at_fault = list(items)
            reason = (
                f"the gradient norm of step {step} was {grad_norm} with every loss finite; "
                "the step was not applied and every batch in it is dead-lettered"
            )
        for item in at_fault:
            self.batches.reject(item.entry_id, reason)
        kept = [item for item in items if item not in at_fault]
        self.buffer = kept + self.buffer
        log.warning(
            "step skipped: its loss or gradient norm was not finite; weights unchanged",
            step=step,
            grad_norm=grad_norm,
            dead_lettered=",".join(item.entry_id for item in at_fault),
            retried=",".join(item.entry_id for item in kept),
            skipped_steps=self.skipped_steps,
        )
        self.telemetry.update(skipped_steps=self.skipped_steps)

    # -- resume checkpoints --------------------------------------------------------------

    def _checkpoint(self) -> None:
        """Save a resume checkpoint; acknowledge what it holds once it is durable.

        A synchronous save is durable when ``save()`` returns. An asynchronous one takes the
        entries trained so far with it and is settled later (``run`` sees it done on every
        rank, or the next checkpoint or the exit waits for it); entries trained meanwhile
        wait for the next checkpoint. DCP's staging copies every tensor before ``save()``
        returns, so the checkpoint holds this step's weights and applied ids. A save that
        fails leaves its entries for the next checkpoint (:meth:`_checkpoint_failed`).
        """
        self._settle()
        state = self.train_state
        if state.step == self.durable_step:
            self.batches.ack(self.to_ack)
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
        settle_now = self.job_config.checkpoint.async_mode == "disabled"
        if not settle_now:  # settled at once on every rank if it failed at once on one
            (settle_now,) = self._max_over_ranks([float(failed_at_once)])
        if settle_now:
            self._settle()
        else:
            log.info(
                "resume checkpoint started",
                step=state.step,
                entries=len(entries),
                seconds=time.perf_counter() - begin,
            )

    def _settle(self) -> None:
        """Wait for the checkpoint in flight, make it durable, acknowledge what it holds.

        Every rank calls this at the same point. Rank 0's save returns after DCP's
        ``.metadata``; the all-reduce after rank 0 checked and fsynced it means no rank
        acknowledges before the checkpoint is complete and durable, and that every rank
        knows whether it failed anywhere.
        """
        saving, self.in_flight = self.in_flight, None
        if saving is None:
            return
        error: BaseException | None = None
        try:
            saving.future.result()
            if self.leader:
                make_durable(self.resume_dir / f"step-{saving.step}")
        except CHECKPOINT_ERRORS as exc:
            error = exc
        (failed,) = self._max_over_ranks([float(error is not None)])
        if failed:
            self.checkpointer.save_future = None  # torchtitan would re-raise it on next save
            self._checkpoint_failed(saving.step, error, saving.entry_ids)
            return
        # result() may return just before the done callback has run: then it is now.
        seconds = (saving.finished or time.perf_counter()) - saving.started
        self.durable_step = saving.step
        self.train_state.settled(saving.mark)
        self.batches.ack(saving.entry_ids)
        _barrier()  # rank 0 trims what every rank has just acknowledged
        trimmed = self._trim() if self.trims_stream else 0
        log.info(
            "resume checkpoint",
            step=saving.step,
            acked=len(saving.entry_ids),
            trimmed=trimmed,
            seconds=seconds,
            acked_after=time.perf_counter() - saving.started,
            mode=self.job_config.checkpoint.async_mode,
        )
        self.telemetry.update(
            checkpoint_step=saving.step, checkpoint_seconds=seconds, last_checkpoint_error=""
        )

    def _checkpoint_failed(
        self, step: int, error: BaseException | None, entry_ids: list[str]
    ) -> None:
        """Training goes on; the entries wait, unacknowledged, for the next checkpoint.

        Rank 0 removes what the failed save left (it frees the space, and torchtitan's
        retention must never count it and delete a complete checkpoint in its place). A full
        disk does not always say so (torch's writer reports a short write as "unexpected
        pos"), so the log compares the free space with what a checkpoint needs.
        """
        self.to_ack = entry_ids + self.to_ack
        self.checkpoint_failures += 1
        if self.leader:
            remove_dir(self.resume_dir / f"step-{step}")
        _barrier()
        text = _describe(error) if error is not None else "failed on another rank"
        needed = self._checkpoint_bytes()
        free = shutil.disk_usage(self.resume_dir).free
        full = free < needed or _disk_full(error)
        log.error(
            "resume checkpoint failed; training goes on, nothing is acknowledged until a "
            "later checkpoint is written" + (f" (free space in {self.resume_dir})" if full else ""),
            step=step,
            error=text,
            resume_dir=str(self.resume_dir),
            free_bytes=free,
            needed_bytes=needed,
            unacknowledged=len(self.to_ack),
            durable_step=self.durable_step,
        )
        self.telemetry.update(
            checkpoint_failures=self.checkpoint_failures,
            last_checkpoint_error=f"step {step}: {text}",
        )

    def _checkpoint_bytes(self) -> int:
        """About the bytes one resume checkpoint takes: model and optimizer tensors."""
        tensors = [*self.model_parts[0].state_dict().values()]
        tensors += self.optimizers.state_dict().values()
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def _trim(self) -> int:
        return self.outage.call(
            lambda: trim_acknowledged(self.redis, self.keys), "trimming the stream"
        )

    # -- publishing, reporting, stopping -------------------------------------------------

    def _publish(self) -> None:
        """Start a snapshot unless a write is running on any rank (then skip and count it)."""
        step = self.train_state.step
        (busy,) = self._max_over_ranks([float(self.snapshots.busy())])
        if busy:
            self.publish_skipped += 1
            log.warning("snapshot skipped: the previous write is still running", step=step)
            return
        self.snapshots.start(self.model_parts[0], step)

    def _report(self, force: bool = False) -> None:
        snapshots = self.snapshots
        self.telemetry.update(
            stale_dropped=self.batches.stale_dropped,
            dead_lettered=self.batches.dead_lettered,
            already_applied=self.batches.already_applied,
            publish_skipped=self.publish_skipped,
            skipped_steps=self.skipped_steps,
            checkpoint_failures=self.checkpoint_failures,
            snapshots_written=snapshots.written,
            snapshots_skipped_no_space=snapshots.skipped_no_space,
            last_snapshot=snapshots.last_path,
            snapshot_stage_seconds=snapshots.stage_seconds,
            snapshot_write_seconds=snapshots.write_seconds,
        )
        self.telemetry.heartbeat(force=force)

    def _finish(self) -> None:
        """Checkpoint and acknowledge what was trained; at ``steps``, publish the last step.

        The last snapshot is written even when a resumed run finds ``steps`` already done,
        so a run always ends with a snapshot of its final weights.
        """
        self.snapshots.wait()
        _barrier()
        step = self.train_state.step
        if self.cfg.steps and step >= self.cfg.steps and self.snapshots.last_step != step:
            self.snapshots.start(self.model_parts[0], step)  # no write is running: waited above
            self.snapshots.wait()
            _barrier()
        self._final_checkpoint()
        self._report(force=True)
        log.info(
            "trainer stopped",
            step=self.train_state.step,
            dead_lettered=self.batches.dead_lettered,
            stale_dropped=self.batches.stale_dropped,
            skipped_steps=self.skipped_steps,
            publish_skipped=self.publish_skipped,
            unread=len(self.buffer),
        )

    def _final_checkpoint(self) -> None:
        """Checkpoint what was trained, retrying with back-off while the save fails.

        A full disk at exit is waited out (each failure is logged); a signal that arrives
        meanwhile gives up, leaving the entries pending for the next run to train again.
        """
        signals = self.stop_signals
        pause = 1.0
        while True:
            self._checkpoint()
            self._settle()
            if self.train_state.step == self.durable_step:
                return
            (give_up,) = self._max_over_ranks([float(self.stop_signals > signals)])
            if give_up:
                raise CheckpointNotWritten(
                    f"stopped before a resume checkpoint of step {self.train_state.step} could "
                    f"be written to {self.resume_dir}; the {len(self.to_ack)} entries trained "
                    f"since step {self.durable_step} stay pending and are trained again by the "
                    "next run"
                )
            log.warning("retrying the last resume checkpoint", retry_in=pause)
            self._report(force=True)
            time.sleep(pause)
            pause = min(2 * pause, FINAL_RETRY_MAX_S)

    # -- collectives -----------------------------------------------------------------------

    def _max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's maximum over all ranks (a flag true anywhere is true everywhere)."""
        if self.world == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor.tolist()

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        tensor = tensor.to(self.device)
        torch.distributed.all_reduce(tensor)
        return tensor.cpu()

    def _gather_ids(self, entry_ids: list[str]) -> torch.Tensor:
        """Every rank's applied ids of this step, rank by rank (tensors, no pickle).

        Ranks may apply different numbers of entries in a step (a suspect trains alone), so
        the counts are gathered first and the ids padded to the largest.
        """
        ids = encode_ids(entry_ids)
        if self.world == 1:
            return ids
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        torch.distributed.all_gather(counts, torch.tensor([len(ids)], device=self.device))
        largest = max(int(c.item()) for c in counts)
        padded = torch.zeros(largest, 2, dtype=torch.int64)
        padded[: len(ids)] = ids
        parts = [torch.empty_like(padded, device=self.device) for _ in range(self.world)]
        torch.distributed.all_gather(parts, padded.to(self.device))
        return torch.cat([p[: int(n.item())].cpu() for p, n in zip(parts, counts, strict=True)])

    # -- torchtitan's Stateful train state and signals -----------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.train_state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_state.load_state_dict(state_dict)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            log.info("stop requested; finishing the current step", signal=signum)
            self.stop_signals += 1

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def _load_loss(name: str) -> LossFn:
    try:
        return get_loss(name)
    except ValueError as exc:
        raise ConfigError(f"trainer.loss: {exc}") from None


def _quiet_cpu_warnings() -> None:
    for message in _CPU_NOISE:
        warnings.filterwarnings("ignore", message=message)


def _default_dist_env() -> None:
    """Outside torchrun, run as a world of one.

    Its store listens on port 0, a port the kernel picks when it binds: nobody else needs to
    find it, and a port chosen beforehand could be taken by another process in between.
    """
    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "0"),
    ):
        os.environ.setdefault(name, value)


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


def _barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        },
    )
