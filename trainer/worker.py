"""The training loop: read micro-batches, step, checkpoint, acknowledge, snapshot every K.

``Trainer`` is torchtitan's ForgeEngine (model, parallelism, optimizer, LR schedule, resume
checkpointer) plus the pieces weightcast adds: a Redis batch source, a policy loss, the train
state of applied stream ids, a background snapshot writer and telemetry.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import redis
import torch
from torchtitan.distributed import utils as dist_utils
from torchtitan.experiments.forge.engine import ForgeEngine
from torchtitan.experiments.forge.job_config import ForgeJobConfig

from weightcast.contract.codec import BatchLimits, RolloutBatch
from weightcast.contract.errors import ConfigError
from weightcast.contract.keys import Keys
from weightcast.contract.streams import trim_acknowledged
from weightcast.runtime.config import Config, TrainerConfig, resume_dir
from weightcast.runtime.logs import get_logger
from weightcast.runtime.net import free_port
from weightcast.trainer.batch_source import BatchSource, SourceSettings, StreamBatch
from weightcast.trainer.loss import LossSettings, get_loss, policy_entropy, trained_tokens
from weightcast.trainer.model import TRAIN_SPEC_NAME, flavor_args, hf_config, register_train_spec
from weightcast.trainer.resume import (
    TrainState,
    encode_ids,
    make_durable,
    newest_checkpoint,
    remove_partial,
)
from weightcast.trainer.snapshot import SnapshotWriter
from weightcast.trainer.telemetry import Telemetry

log = get_logger("trainer")

UNBOUNDED_STEPS = 10**9
"""The LR schedule's horizon when training runs until stopped."""

RESUME_EVERY = 10
"""Default steps between resume checkpoints (torchtitan's ``checkpoint.interval``)."""

ASYNC_MODES = ("disabled", "async")
"""``[trainer.checkpoint] async_mode`` values: a blocking save, or DCP's async_save in a thread."""

STEP_METRICS = ("loss", "kl", "entropy", "clip_fraction")
"""Per-step figures averaged over the trained tokens of all micro-batches and ranks."""

_CPU_NOISE = (
    "DTensor random operators may not have complete support on cpu",
    "DTensor manual_seed\\(\\) may not have complete support on cpu",
    "In CPU autocast, but the target dtype is not supported",
)
"""torchtitan's warnings on every CPU start; they say nothing the user can act on."""


def build_job_config(cfg: TrainerConfig, resume_dir: Path | None = None) -> ForgeJobConfig:
    """torchtitan's job config: weightcast's defaults, then the ``[trainer.*]`` overrides.

    Resume checkpoints use torchtitan's checkpointer (always on, in ``resume_dir``):
    every ``checkpoint.interval`` steps (10) and at exit, the newest ``keep_latest_k`` (2)
    kept, full state (not model-only) also at the last step.
    """
    job = ForgeJobConfig()
    job.model.name = TRAIN_SPEC_NAME
    job.model.flavor = cfg.model
    job.model.hf_assets_path = None
    job.training.seq_len = cfg.seq_len
    job.training.steps = cfg.steps or UNBOUNDED_STEPS
    job.training.local_batch_size = 1
    job.training.seed = cfg.seed
    job.training.mixed_precision_param = "bfloat16" if torch.cuda.is_available() else "float32"
    job.lr_scheduler.warmup_steps = 2
    job.lr_scheduler.decay_ratio = 0.0
    job.checkpoint.interval = RESUME_EVERY
    job.checkpoint.keep_latest_k = 2
    job.comm.trace_buf_size = 0
    for section_name, values in cfg.titan.items():
        section = getattr(job, section_name, None)
        if not dataclasses.is_dataclass(section):
            known = ", ".join(f.name for f in dataclasses.fields(job))
            raise ConfigError(
                f"unknown torchtitan section [trainer.{section_name}]; known: {known}"
            )
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(
                    f"[trainer.{section_name}] has no setting {key!r}; "
                    f"known: {', '.join(sorted(names))}"
                )
            setattr(section, key, value)
    if job.model.name != TRAIN_SPEC_NAME:
        raise ConfigError(
            f"[trainer.model] name must stay {TRAIN_SPEC_NAME!r} (choose the flavor instead)"
        )
    job.checkpoint.enable = True
    job.checkpoint.folder = str(resume_dir or Path(job.checkpoint.folder).absolute())
    job.checkpoint.last_save_model_only = False
    job.checkpoint.async_mode = job.checkpoint.async_mode.lower()
    if job.checkpoint.async_mode not in ASYNC_MODES:
        raise ConfigError(
            f"[trainer.checkpoint] async_mode {job.checkpoint.async_mode!r} is not supported; "
            f"choose one of {', '.join(ASYNC_MODES)} ('async_with_pinned_mem' needs "
            "torchtitan's GPU staging path, which weightcast does not drive)"
        )
    if job.checkpoint.interval < 1:
        raise ConfigError("[trainer.checkpoint] interval must be >= 1")
    if job.checkpoint.keep_latest_k == 1:
        raise ConfigError(
            "[trainer.checkpoint] keep_latest_k must be 0 (keep all) or >= 2: the newest "
            "checkpoint may be unfinished when the trainer dies, and the one before it is "
            "what it resumes from"
        )
    return job


@dataclasses.dataclass
class InFlightCheckpoint:
    """An asynchronous resume checkpoint being written and the entries it alone holds."""

    step: int
    entry_ids: list[str]
    future: Future[Any]
    started: float
    finished: float = 0.0

    def __post_init__(self) -> None:
        self.future.add_done_callback(lambda _: setattr(self, "finished", time.perf_counter()))


class Trainer(ForgeEngine):
    """torchtitan's engine driven by rollout batches from Redis.

    One optimizer step takes ``micro_batches`` stream entries on every DP rank. An entry is
    acknowledged only once a resume checkpoint holding its update is durable and complete on
    every rank, and the train state in that checkpoint lists it, so a restart neither loses
    nor repeats it. With ``async_mode = "async"`` the checkpoint is written in the background
    while training goes on; its entries are acknowledged when every rank reports it done.
    """

    def __init__(self, config: Config) -> None:
        cfg = config.trainer
        for message in _CPU_NOISE:
            warnings.filterwarnings("ignore", message=message)
        try:
            self.loss = get_loss(cfg.loss)
        except ValueError as exc:
            raise ConfigError(f"trainer.loss: {exc}") from None
        register_train_spec()
        self.resume_dir = resume_dir(config)
        job = build_job_config(cfg, self.resume_dir)
        self.flavor_name = job.model.flavor
        flavor = flavor_args(self.flavor_name)
        self.train_state = TrainState(cfg.applied_history)
        _default_dist_env()
        super().__init__(job)
        dims = self.parallel_dims
        if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled:
            raise ConfigError(
                "only data parallelism (FSDP) is supported: every rank reads its own batches"
            )
        self.cfg = cfg
        self.loss_settings = LossSettings(clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef)
        self.stop_requested = False
        self.leader = torch.distributed.get_rank() == 0
        self.world = torch.distributed.get_world_size()
        self.trims_stream = cfg.trim_stream and self.leader  # one rank trims for all
        # The checkpoint cadence is weightcast's (acks wait for it); torchtitan saves when asked.
        self.resume_every = self.checkpointer.interval
        self.checkpointer.interval = 1
        self.checkpointer.states.pop("dataloader", None)
        self.in_flight: InFlightCheckpoint | None = None
        self.checkpointed_step = self._resume()
        self.run_id = cfg.run_id or self.train_state.run_id or self._new_run_id()
        self.train_state.run_id = self.run_id
        consumer = cfg.consumer or socket.gethostname()
        self.consumer = f"{consumer}-dp{self.dp_rank}" if self.dp_degree > 1 else consumer
        self.keys = Keys(config.common.namespace)
        self.redis = redis.Redis.from_url(config.common.redis_url)
        self.batches = BatchSource(
            self.redis,
            self.keys,
            self.consumer,
            BatchLimits(vocab_size=flavor.vocab_size, max_seq_len=cfg.seq_len),
            SourceSettings(
                block_ms=cfg.block_ms,
                max_deliveries=cfg.max_deliveries,
                dead_letters_kept=cfg.dead_letters_kept,
                claim_idle_ms=int(cfg.claim_idle_s * 1000),
                max_policy_lag=cfg.max_policy_lag,
            ),
        )
        self.batches.recover(self.train_state.applied_set)
        self.batches.ack([])  # what the loaded checkpoint holds is durable already
        self.buffer: list[StreamBatch] = []
        self.to_ack: list[str] = []  # trained, in no checkpoint started yet
        adapter = self.train_spec.state_dict_adapter(self.model_args, None)
        self.snapshots = SnapshotWriter(
            config.common.checkpoint_dir,
            adapter.to_hf,
            hf_config(flavor),
            self.flavor_name,
            self.run_id,
        )
        self.publish_skipped = 0
        self.telemetry = Telemetry(self.redis, self.keys, cfg.metrics_port, self.leader)
        self.telemetry.update(
            step=self.train_state.step,
            run_id=self.run_id,
            consumer=consumer,
            last_snapshot="",
            world_size=self.world,
        )

    def train_step(self, batches: list[RolloutBatch]) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches; returns the job's metrics.

        Each micro-batch's loss (a mean over its trained tokens) is weighted by its share of
        the trained tokens of the whole step on all ranks, so the update is the one a single
        batch holding every sequence would give.
        """
        self.optimizers.zero_grad()
        model = self.model_parts[0]
        tokens = [trained_tokens(b) for b in batches]
        total = self._all_reduce(torch.tensor([float(sum(tokens))]))[0].item()
        sums = torch.zeros(2 * len(STEP_METRICS) + 1)
        for batch, count in zip(batches, tokens, strict=True):
            batch = _to_device(batch, self.device)
            with self.train_context(None), self.maybe_enable_amp:
                logits = model(batch.input_ids)
                result = self.loss(logits, batch, self.loss_settings)
            values = {
                **result.metrics,
                "loss": result.loss.item(),
                "entropy": policy_entropy(logits, batch).item(),
            }
            del logits
            (result.loss * (count * self.dp_degree / total)).backward()
            for i, name in enumerate(STEP_METRICS):
                if name in values:
                    sums[2 * i] += values[name] * count
                    sums[2 * i + 1] += count
            sums[-1] += batch.num_tokens
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
        )
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]  # the rate this step uses
        self.optimizers.step()
        self.lr_schedulers.step()
        sums = self._all_reduce(sums)
        metrics = {
            name: (sums[2 * i] / sums[2 * i + 1]).item()
            for i, name in enumerate(STEP_METRICS)
            if sums[2 * i + 1] > 0
        }
        return {**metrics, "grad_norm": grad_norm.item(), "lr": lr, "tokens": sums[-1].item()}

    def run(self) -> None:
        """Train until ``steps`` are in the train state or SIGTERM/SIGINT asks to stop.

        Every rank takes the same decisions: a flag all-reduce each round says whether
        to stop, whether every rank has its micro-batches, whether an asynchronous resume
        checkpoint is still being written anywhere, and (on publish steps) whether a
        snapshot write is still running anywhere.
        """
        self._install_signal_handlers()
        steps = self.cfg.steps
        log.info(
            "trainer started",
            run_id=self.run_id,
            consumer=self.consumer,
            model=self.flavor_name,
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
            waiting = len(self.buffer) < self.cfg.micro_batches
            saving = self.in_flight is not None and not self.in_flight.future.done()
            stop, waiting, saving = self._agree(self.stop_requested, waiting, saving)
            if self.in_flight is not None and not saving:
                self._settle()  # done on every rank: nothing to wait for
            if stop:
                break
            if waiting:
                self._report()
                continue
            self._step()
        self._finish()

    def _step(self) -> None:
        """Train one step, then checkpoint and start a snapshot when due.

        ``step_seconds`` covers all of it (a snapshot costs the loop its staging copy), so
        the heartbeat's ``tokens_per_s`` is what training really sustains.
        """
        start = time.perf_counter()
        wanted = self.cfg.micro_batches
        items, self.buffer = self.buffer[:wanted], self.buffer[wanted:]
        metrics = self.train_step([item.batch for item in items])
        state = self.train_state
        state.record(self._gather_ids([item.entry_id for item in items]))
        state.step += 1
        self.to_ack += [item.entry_id for item in items]
        if state.step != self.cfg.steps:  # the last step's are written by _finish
            if state.step % self.resume_every == 0:
                self._checkpoint()
            if state.step % self.cfg.publish_every == 0:
                self._publish()
        seconds = time.perf_counter() - start
        lag = self.batches.policy_lag(min(item.batch.policy_version for item in items))
        tokens = metrics.pop("tokens")
        self.telemetry.update(
            step=state.step,
            **metrics,
            tokens_per_s=tokens / seconds,
            step_seconds=seconds,
            last_policy_lag=lag,
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

    def _fill(self) -> None:
        """Read until this rank holds its micro-batches or one wait came back empty."""
        while len(self.buffer) < self.cfg.micro_batches and not self.stop_requested:
            item = self.batches.poll()
            if item is None:
                return
            self.buffer.append(item)

    def _checkpoint(self) -> None:
        """Save a resume checkpoint; acknowledge what it holds once it is durable.

        A synchronous save is durable when ``save()`` returns. An asynchronous one takes the
        entries trained so far with it and is settled later (``run`` sees it done on every
        rank, or the next checkpoint or the exit waits for it); entries trained meanwhile
        wait for the next checkpoint. DCP's staging copies every tensor before ``save()``
        returns, so the checkpoint holds this step's weights and applied ids.
        """
        self._settle()
        state = self.train_state
        if state.step == self.checkpointed_step:
            self.batches.ack(self.to_ack)
            self.to_ack = []
            return
        begin = time.perf_counter()
        state.checkpointed()
        self.checkpointer.save(state.step)
        self.in_flight = InFlightCheckpoint(
            state.step, self.to_ack, self.checkpointer.save_future or _done(), begin
        )
        self.to_ack = []
        self.checkpointed_step = state.step
        if self.checkpointer.save_future is None:
            self._settle()
        else:
            log.info(
                "resume checkpoint started",
                step=state.step,
                entries=len(self.in_flight.entry_ids),
                seconds=time.perf_counter() - begin,
            )

    def _settle(self) -> None:
        """Wait for the checkpoint in flight, make it durable, acknowledge what it holds.

        Every rank calls this at the same point. Rank 0's save returns after DCP's
        ``.metadata``; the barrier after rank 0 checked and fsynced it means no rank
        acknowledges before the checkpoint is complete and durable.
        """
        saving, self.in_flight = self.in_flight, None
        if saving is None:
            return
        saving.future.result()  # a failed save raises: its entries stay pending
        # result() may return just before the done callback has run: then it is now.
        seconds = (saving.finished or time.perf_counter()) - saving.started
        if self.leader:
            make_durable(self.resume_dir / f"step-{saving.step}")
        _barrier()
        self.batches.ack(saving.entry_ids)
        _barrier()  # rank 0 trims what every rank has just acknowledged
        trimmed = trim_acknowledged(self.redis, self.keys) if self.trims_stream else 0
        log.info(
            "resume checkpoint",
            step=saving.step,
            acked=len(saving.entry_ids),
            trimmed=trimmed,
            seconds=seconds,
            acked_after=time.perf_counter() - saving.started,
            mode=self.job_config.checkpoint.async_mode,
        )
        self.telemetry.update(checkpoint_step=saving.step, checkpoint_seconds=seconds)

    def _publish(self) -> None:
        """Start a snapshot unless a write is running on any rank (then skip and count it)."""
        step = self.train_state.step
        (busy,) = self._agree(self.snapshots.busy())
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
        self._checkpoint()
        self._settle()
        self._report(force=True)
        log.info(
            "trainer stopped",
            step=self.train_state.step,
            dead_lettered=self.batches.dead_lettered,
            stale_dropped=self.batches.stale_dropped,
            publish_skipped=self.publish_skipped,
            unread=len(self.buffer),
        )

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

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Every flag made true on all ranks if it is true on any one."""
        if self.world == 1:
            return tuple(flags)
        tensor = torch.tensor([float(f) for f in flags], device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tuple(bool(v) for v in tensor.tolist())

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return tensor
        tensor = tensor.to(self.device)
        torch.distributed.all_reduce(tensor)
        return tensor.cpu()

    def _gather_ids(self, entry_ids: list[str]) -> torch.Tensor:
        """Every rank's applied ids of this step, rank by rank (tensors, no pickle)."""
        ids = encode_ids(entry_ids)
        if self.world == 1:
            return ids
        parts = [torch.empty_like(ids, device=self.device) for _ in range(self.world)]
        torch.distributed.all_gather(parts, ids.to(self.device))
        return torch.cat([p.cpu() for p in parts])

    def state_dict(self) -> dict[str, Any]:
        return self.train_state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_state.load_state_dict(state_dict)

    def _new_run_id(self) -> str:
        """A fresh run id, rank 0's on every rank (sent as a tensor, not pickled)."""
        token = torch.tensor(list(uuid.uuid4().bytes[:6]), dtype=torch.uint8, device=self.device)
        if self.world > 1:
            torch.distributed.broadcast(token, src=0)
        return bytes(token.tolist()).hex()

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            log.info("stop requested; finishing the current step", signal=signum)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def _default_dist_env() -> None:
    """Outside torchrun, run as a world of one."""
    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _done() -> Future[Any]:
    """A future already finished: what a synchronous save leaves to wait for."""
    future: Future[Any] = Future()
    future.set_result(None)
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
