"""The training loop: read a batch, take an optimizer step, acknowledge, snapshot every K.

``Trainer`` is torchtitan's ForgeEngine (model, parallelism, optimizer, LR schedule) plus the
pieces weightcast adds: a Redis batch source, a policy loss and a snapshot writer.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
import uuid
import warnings
from typing import Any

import redis
import torch
from torchtitan.distributed import utils as dist_utils
from torchtitan.experiments.forge.engine import ForgeEngine
from torchtitan.experiments.forge.job_config import ForgeJobConfig

from shared.codec import BatchLimits, RolloutBatch
from shared.config import Config, ConfigError, TrainerConfig
from shared.keys import Keys
from shared.logs import get_logger
from shared.redis_server import free_port
from trainer.batch_source import BatchSource
from trainer.loss import LossSettings, get_loss
from trainer.model import TRAIN_SPEC_NAME, flavor_args, hf_config, register_train_spec
from trainer.snapshot import SnapshotWriter

log = get_logger("trainer")

UNBOUNDED_STEPS = 10**9
"""The LR schedule's horizon when training runs until stopped."""

_CPU_NOISE = (
    "DTensor random operators may not have complete support on cpu",
    "DTensor manual_seed\\(\\) may not have complete support on cpu",
    "In CPU autocast, but the target dtype is not supported",
)
"""torchtitan's warnings on every CPU start; they say nothing the user can act on."""


def build_job_config(cfg: TrainerConfig) -> ForgeJobConfig:
    """torchtitan's job config: weightcast's defaults, then the ``[trainer.*]`` overrides."""
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
    job.checkpoint.enable = False
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
    return job


class Trainer(ForgeEngine):
    """torchtitan's engine driven by rollout batches from Redis."""

    def __init__(self, config: Config) -> None:
        cfg = config.trainer
        if cfg.publish_every < 1:
            raise ConfigError(f"trainer.publish_every must be >= 1, got {cfg.publish_every}")
        for message in _CPU_NOISE:
            warnings.filterwarnings("ignore", message=message)
        register_train_spec()
        flavor = flavor_args(cfg.model)
        _default_dist_env()
        super().__init__(build_job_config(cfg))
        self.cfg = cfg
        self.step = 0
        self.stop_requested = False
        self.run_id = cfg.run_id or self._new_run_id()
        self.consumer = cfg.consumer or f"{socket.gethostname()}-{os.getpid()}"
        if self.dp_degree > 1:
            self.consumer = f"{self.consumer}-dp{self.dp_rank}"
        self.keys = Keys(config.common.namespace)
        self.redis = redis.Redis.from_url(config.common.redis_url)
        self.batches = BatchSource(
            self.redis,
            self.keys,
            self.consumer,
            BatchLimits(vocab_size=flavor.vocab_size, max_seq_len=cfg.seq_len),
            block_ms=cfg.block_ms,
        )
        self.loss = get_loss(cfg.loss)
        self.loss_settings = LossSettings(clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef)
        adapter = self.train_spec.state_dict_adapter(self.model_args, None)
        self.snapshots = SnapshotWriter(
            config.common.checkpoint_dir,
            adapter.to_hf,
            hf_config(flavor),
            cfg.model,
            self.run_id,
        )
        self.last_snapshot = ""

    def train_step(self, batch: RolloutBatch) -> dict[str, Any]:
        """One optimizer step on one micro-batch; returns the step's metrics."""
        self.optimizers.zero_grad()
        model = self.model_parts[0]
        batch = _to_device(batch, self.device)
        with self.train_context(None), self.maybe_enable_amp:
            logits = model(batch.input_ids)
            result = self.loss(logits, batch, self.loss_settings)
        del logits
        result.loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
        )
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]  # the rate this step uses
        self.optimizers.step()
        self.lr_schedulers.step()
        return {
            "loss": result.loss.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            **result.metrics,
        }

    def run(self) -> None:
        """Train until ``steps`` are done or SIGTERM/SIGINT asks to stop (after the step)."""
        self._install_signal_handlers()
        steps = self.cfg.steps
        log.info(
            "trainer started",
            run_id=self.run_id,
            consumer=self.consumer,
            model=self.cfg.model,
            steps=steps or "unbounded",
            publish_every=self.cfg.publish_every,
            device=str(self.device),
        )
        self._heartbeat()
        while not (steps and self.step >= steps) and not self.stop_requested:
            item = self.batches.next(lambda: self.stop_requested)
            if item is None:
                break
            start = time.perf_counter()
            metrics = self.train_step(item.batch)
            self.batches.ack(item.entry_id)
            self.step += 1
            seconds = time.perf_counter() - start
            log.info(
                "step",
                step=self.step,
                **metrics,
                tokens_per_s=item.batch.num_tokens / seconds,
                policy_version=item.batch.policy_version,
                entry=item.entry_id,
            )
            if self.step % self.cfg.publish_every == 0 or self.step == steps:
                self.last_snapshot = str(self.snapshots.write(self.model_parts[0], self.step))
            self._heartbeat()
        log.info("trainer stopped", step=self.step, dead_lettered=self.batches.dead_lettered)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]

    def _new_run_id(self) -> str:
        """A fresh run id, rank 0's on every rank (sent as a tensor, not pickled)."""
        token = torch.tensor(list(uuid.uuid4().bytes[:6]), dtype=torch.uint8, device=self.device)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast(token, src=0)
        return bytes(token.tolist()).hex()

    def _heartbeat(self) -> None:
        if torch.distributed.get_rank() != 0:
            return
        self.redis.hset(
            self.keys.trainer_heartbeat,
            mapping={
                "step": self.step,
                "run_id": self.run_id,
                "consumer": self.consumer,
                "last_snapshot": self.last_snapshot,
                "at": time.time(),
            },
        )

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            log.info("stop requested; finishing the current step", signal=signum)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def run_trainer(config: Config) -> int:
    trainer = Trainer(config)
    try:
        trainer.run()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


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


def _to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        },
    )
