"""The training loop: read micro-batches, step, checkpoint, acknowledge, snapshot every K.

``Trainer`` is torchtitan's ForgeEngine (model, parallelism, optimizer, LR schedule, resume
checkpointer) plus the pieces weightcast adds: a Redis batch source, a policy loss, the train
state of applied stream ids, a background snapshot writer, the weights of the steps it
published last (to score the train/inference mismatch of lagged batches,
:mod:`weightcast_trainer.lagged_mismatch`) and telemetry. What a step computes is
:mod:`weightcast_trainer.train_step`'s; the loop decides what it trains and what becomes of
its batches.

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

import contextlib
import os
import signal
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torchtitan.experiments.forge.engine import ForgeEngine
from torchtitan.experiments.forge.job_config import ForgeJobConfig

from weightcast.contract.codec import BatchLimits
from weightcast.contract.errors import ConfigError
from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.keys import Keys
from weightcast.contract.streams import trim_acknowledged
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.redis_client import REPLY_TIMEOUT_S, redis_client
from weightcast.runtime.retry import Outage
from weightcast_trainer import collectives
from weightcast_trainer.batch_source import BatchSource, SourceSettings, StreamBatch
from weightcast_trainer.hf_start import StartCheckpoint, load_start, start_config
from weightcast_trainer.lagged_mismatch import score_lagged, scored_lags
from weightcast_trainer.loss import LossFn, LossSettings, get_loss
from weightcast_trainer.model import START_FLAVOR, flavor_args, hf_config, register_train_spec
from weightcast_trainer.resume import TrainState, resume_dir
from weightcast_trainer.resume_checkpoints import ResumeCheckpoints, load_newest
from weightcast_trainer.sampling_weights import SamplingWeights, capacity_for, version_bytes
from weightcast_trainer.snapshot_writer import SnapshotWriter
from weightcast_trainer.step_plan import StepPlan, decide, local_view
from weightcast_trainer.telemetry import Telemetry
from weightcast_trainer.train_step import StepOutcome, StepParts, train_step

log = get_logger("trainer")

_CPU_NOISE = (
    "DTensor random operators may not have complete support on cpu",
    "DTensor manual_seed\\(\\) may not have complete support on cpu",
    "In CPU autocast, but the target dtype is not supported",
)
"""torchtitan's warnings on every CPU start; they say nothing the user can act on."""


class Trainer(ForgeEngine):
    """torchtitan's engine driven by rollout batches from Redis.

    One optimizer step takes ``micro_batches`` stream entries on every DP rank. An entry is
    acknowledged only once a resume checkpoint holding its update is durable and complete on
    every rank, and the train state in that checkpoint lists it, so a restart neither loses
    nor repeats it. With ``async_mode = "async"`` the checkpoint is written in the background
    while training goes on; its entries are acknowledged when every rank reports it done.
    """

    def __init__(
        self, config: Config, job: ForgeJobConfig, start: StartCheckpoint | None = None
    ) -> None:
        """``job`` is :func:`~weightcast_trainer.job.build_job_config`'s; ``start`` the
        checked ``--init-from`` checkpoint (:func:`~weightcast_trainer.hf_start.inspect_start`)."""
        self.cfg = config.trainer
        self.start = start
        loss = _load_loss(self.cfg.loss)  # a bad name fails before the model is built
        self.resume_dir = resume_dir(config)
        self.train_state = TrainState(self.cfg.applied_history)
        _quiet_cpu_warnings()
        _default_dist_env()
        register_train_spec(start.args if start is not None else None)
        super().__init__(job)  # torchtitan: process group, model, optimizer, LR, checkpointer
        self._require_data_parallel_only()
        self.leader = torch.distributed.get_rank() == 0
        self.world = torch.distributed.get_world_size()
        self._take_over_checkpoint_cadence()
        durable = load_newest(self.checkpointer, self.train_state, self.resume_dir, self.leader)
        self.fresh_start = durable == 0
        if self.fresh_start and start is not None:  # a resumed run never reloads its start
            self._load_start(start)
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
        self.step_parts = self._step_parts(loss)
        self.sampling_weights = self._sampling_weights()
        self.telemetry = Telemetry(
            self.redis, self.keys, self.cfg.metrics_port, self.leader, self.outage
        )
        self.resume_checkpoints = ResumeCheckpoints(
            self.checkpointer,
            self.train_state,
            self.resume_dir,
            durable,
            asynchronous=job.checkpoint.async_mode == "async",
            ack=self.batches.ack,
            trim=self._trim if self.cfg.trim_stream and self.leader else None,  # one for all
            telemetry=self.telemetry,
            needed_bytes=self._checkpoint_bytes,
            device=self.device,
            leader=self.leader,
        )
        self._start_loop_state()
        self.telemetry.update(
            Heartbeat(
                step=self.train_state.step,
                run_id=self.run_id,
                consumer=self.cfg.consumer or socket.gethostname(),
                last_snapshot="",
                world_size=self.world,
                last_checkpoint_error="",
            )
        )

    # -- construction, in the order __init__ runs it --------------------------------------

    def _require_data_parallel_only(self) -> None:
        """FSDP only; an MoE's experts split evenly over the FSDP ranks (torchtitan's
        state-dict adapter, which names them for loads and snapshots, needs it)."""
        dims = self.parallel_dims
        if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled or dims.ep_enabled:
            raise ConfigError(
                "only data parallelism (FSDP) is supported: every rank reads its own batches"
            )
        experts = self.model_args.moe_args.num_experts if self.model_args.moe_enabled else 0
        if experts % dims.dp_shard:
            raise ConfigError(
                f"the model's {experts} experts do not split evenly over {dims.dp_shard} FSDP "
                "ranks; run a number of ranks that divides them"
            )

    def _take_over_checkpoint_cadence(self) -> None:
        """Resume checkpoints are due when weightcast says (acks wait for them), so
        torchtitan's checkpointer saves whenever asked; it saves no dataloader (Redis is
        the data)."""
        self.resume_every = self.checkpointer.interval
        self.checkpointer.interval = 1
        self.checkpointer.states.pop("dataloader", None)

    def _load_start(self, start: StartCheckpoint) -> None:
        began = time.perf_counter()
        load_start(self.model_parts[0], start)
        log.info(
            "started from a checkpoint",
            path=str(start.path),
            tensors=len(start.tensors),
            seconds=time.perf_counter() - began,
        )

    def _new_run_id(self) -> str:
        """A fresh run id, rank 0's on every rank (sent as a tensor, not pickled)."""
        return collectives.broadcast_bytes(uuid.uuid4().bytes[:6], self.device).hex()

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
            BatchLimits(vocab_size=self.model_args.vocab_size, max_seq_len=cfg.seq_len),
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
        if self.start is None:
            model, snapshot_config = self.cfg.model, hf_config(flavor_args(self.cfg.model))
        else:
            model, snapshot_config = START_FLAVOR, start_config(self.start.hf_config)
        return SnapshotWriter(
            config.common.checkpoint_dir, adapter.to_hf, snapshot_config, model, self.run_id
        )

    def _step_parts(self, loss: LossFn) -> StepParts:
        """What :func:`~weightcast_trainer.train_step.train_step` works on, torchtitan's."""
        cfg = self.cfg
        return StepParts(
            model=self.model_parts[0],  # one part: pipeline parallelism is refused
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            loss=loss,
            loss_settings=LossSettings(
                clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef, dual_clip=cfg.dual_clip
            ),
            max_norm=self.job_config.training.max_norm,
            device=self.device,
            dp_degree=self.dp_degree,
            forward_context=self._forward_context,
            before_update=self.snapshots.before_weights_change,
        )

    def _sampling_weights(self) -> SamplingWeights:
        """As many published steps' weights as ``mismatch_memory_mb`` holds on every rank
        (the largest rank's shards decide, so every rank keeps the same steps), and no more
        than a batch younger than ``max_policy_lag`` can need."""
        (largest,) = collectives.max_over_ranks(
            [float(version_bytes(self.model_parts[0]))], self.device
        )
        budget = int(self.cfg.mismatch_memory_mb * 2**20)
        capacity = capacity_for(budget, int(largest), self.cfg.max_policy_lag)
        log.info(
            "lagged batches are scored against the weights that sampled them"
            if capacity
            else "lagged batches are not scored for the mismatch: one version's weights "
            "exceed trainer.mismatch_memory_mb",
            versions_kept=capacity,
            version_mb=round(largest / 2**20, 3),
            mismatch_memory_mb=self.cfg.mismatch_memory_mb,
        )
        return SamplingWeights(capacity)

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        with self.train_context(None), self.maybe_enable_amp:
            yield

    def _start_loop_state(self) -> None:
        self.buffer: list[StreamBatch] = []
        self.stop_signals = 0
        self.publish_skipped = 0
        self.skipped_steps = 0

    @property
    def stop_requested(self) -> bool:
        return self.stop_signals > 0

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Train until ``steps`` are in the train state or SIGTERM/SIGINT asks to stop.

        Every rank takes the same decisions: one all-reduce each round says whether to stop,
        whether an asynchronous resume checkpoint is still being written anywhere, and which
        batches the next step trains on each rank (:mod:`weightcast_trainer.step_plan`).
        """
        self._install_signal_handlers()
        steps = self.cfg.steps
        log.info(
            "trainer started",
            run_id=self.run_id,
            consumer=self.consumer,
            model=str(self.start.path) if self.start else self.cfg.model,
            step=self.train_state.step,
            steps=steps or "unbounded",
            micro_batches=self.cfg.micro_batches,
            publish_every=self.cfg.publish_every,
            resume_every=self.resume_every,
            world_size=self.world,
            device=str(self.device),
        )
        self._report(force=True)
        if self.fresh_start and self.start is not None:
            self._publish_start()
        while not (steps and self.train_state.step >= steps):
            self._fill()
            plan = self._plan()
            if not plan.saving:
                self.resume_checkpoints.settle()  # done on every rank: nothing to wait for
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
        saving = self.resume_checkpoints.saving
        attempts = [item.attempts for item in self.buffer]
        local = local_view(
            attempts, self.cfg.micro_batches, rank, self.world, self.stop_requested, saving
        )
        return decide(collectives.max_over_ranks(local, self.device), local, rank)

    def _step(self, plan: StepPlan) -> None:
        """Train one step; apply it, or drop it when it is not finite; then checkpoint and
        start a snapshot when due.

        The step's entries are recorded in Redis while it runs, so that a death inside it
        counts a failed attempt for each. ``step_seconds`` covers all of it (a snapshot costs
        the loop its staging copy), so the heartbeat's ``tokens_per_s`` is what training
        really sustains.
        """
        start = time.perf_counter()
        # ForgeEngine turned Python's automatic GC off (it stalls ranks at random); its
        # handler collects every ``training.gc_freq`` steps, as torchtitan's own loop does,
        # so cycles holding pinned or device memory are freed on long runs.
        self.gc_handler.run(self.train_state.step + 1)
        items, self.buffer = self.buffer[: plan.take], self.buffer[plan.take :]
        self.batches.begin_step([item.entry_id for item in items])
        batches = [item.batch for item in items]
        current = self.train_state.step
        sampled = [self.batches.version_step(batch.policy_version) for batch in batches]
        on_policy = [step == current for step in sampled]
        scored = score_lagged(self.step_parts, self.sampling_weights, batches, sampled, current)
        outcome = train_step(self.step_parts, batches, plan.passes, on_policy, scored)
        if not outcome.applied:
            self.batches.end_step()  # finished: the batches at fault are dead-lettered now
            self._drop(items, outcome)
            self._report(force=True)
            return
        self._applied(items)
        step = self.train_state.step
        if step != self.cfg.steps:  # the last step's are written by _finish
            if step % self.resume_every == 0:
                self.resume_checkpoints.save()
            if step % self.cfg.publish_every == 0:
                self._publish()
        lags = scored_lags(batches, sampled, current, scored)
        self._report_step(items, lags, outcome.metrics, time.perf_counter() - start)

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
        self.telemetry.update(Heartbeat(skipped_steps=self.skipped_steps))

    def _applied(self, items: list[StreamBatch]) -> None:
        """An applied step: its entries (every rank's) join the train state, which counts
        the step, and wait for the resume checkpoint that will hold them."""
        applied = [item.entry_id for item in items]
        self.train_state.record(collectives.gather_ids(applied, self.device))
        self.train_state.step += 1
        self.resume_checkpoints.trained(applied)
        self.batches.end_step()

    def _report_step(
        self,
        items: list[StreamBatch],
        lags: list[int | None],
        metrics: dict[str, float],
        seconds: float,
    ) -> None:
        """The applied step's figures, policy lag and mismatch version: heartbeat, gauges,
        log line. ``lags`` is each batch's lag in steps behind the weights it was trained
        on, where its mismatch was scored (None where it was not)."""
        state = self.train_state
        mismatch_version = None
        if "mismatch_kl" in metrics:  # the same on every rank: the sums were reduced
            pairs = [(item, lag) for item, lag in zip(items, lags, strict=True) if lag is not None]
            figures = collectives.max_over_ranks(
                [
                    max((item.batch.policy_version for item, _ in pairs), default=-1.0),
                    max((lag for _, lag in pairs), default=-1.0),
                ],
                self.device,
            )
            metrics["mismatch_version"] = mismatch_version = int(figures[0])
            metrics["mismatch_lag"] = int(figures[1])
        oldest = min((item.batch.policy_version for item in items), default=None)
        lag = self.batches.policy_lag(oldest) if oldest is not None else None
        tokens = metrics.pop("tokens")
        self.telemetry.update(
            Heartbeat(
                step=state.step,
                loss=metrics.get("loss"),
                kl=metrics.get("kl"),
                entropy=metrics.get("entropy"),
                clip_fraction=metrics.get("clip_fraction"),
                grad_norm=metrics["grad_norm"],
                lr=metrics["lr"],
                mismatch_kl=metrics.get("mismatch_kl"),
                mismatch_max=metrics.get("mismatch_max"),
                mismatch_version=mismatch_version,
                tokens_per_s=tokens / seconds,
                step_seconds=seconds,
                last_policy_lag=lag,
            )
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
        (busy,) = collectives.max_over_ranks([float(self.snapshots.busy())], self.device)
        if busy:
            self.publish_skipped += 1
            log.warning("snapshot skipped: the previous write is still running", step=step)
            return
        self.snapshots.start(self.model_parts[0], step)
        self.sampling_weights.keep(step, self.model_parts[0])

    def _publish_start(self) -> None:
        """A step-0 snapshot of the starting weights, written before the first step, so the
        first version is exactly the trainer's start (a node needs no copy of the directory)."""
        self.snapshots.start(self.model_parts[0], 0)
        self.sampling_weights.keep(0, self.model_parts[0])
        self.snapshots.wait()
        collectives.barrier()
        log.info("published the start", snapshot=self.snapshots.last_path)

    def _report(self, force: bool = False) -> None:
        snapshots = self.snapshots
        self.telemetry.update(
            Heartbeat(
                stale_dropped=self.batches.stale_dropped,
                dead_lettered=self.batches.dead_lettered,
                already_applied=self.batches.already_applied,
                publish_skipped=self.publish_skipped,
                skipped_steps=self.skipped_steps,
                checkpoint_failures=self.resume_checkpoints.failures,
                snapshots_written=snapshots.written,
                snapshots_skipped_no_space=snapshots.skipped_no_space,
                last_snapshot=snapshots.last_path,
                snapshot_stage_seconds=snapshots.stage_seconds,
                snapshot_write_seconds=snapshots.write_seconds,
            )
        )
        self.telemetry.heartbeat(force=force)

    def _finish(self) -> None:
        """Checkpoint and acknowledge what was trained; at ``steps``, publish the last step.

        The last snapshot is written even when a resumed run finds ``steps`` already done,
        so a run always ends with a snapshot of its final weights.
        """
        self.snapshots.wait()
        collectives.barrier()
        step = self.train_state.step
        if self.cfg.steps and step >= self.cfg.steps and self.snapshots.last_step != step:
            self.snapshots.start(self.model_parts[0], step)  # no write is running: waited above
            self.snapshots.wait()
            collectives.barrier()
        self.resume_checkpoints.save_final(lambda: self.stop_signals, lambda: self._report(True))
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
