"""The trainer's settings (``[trainer]``, ``weightcast trainer``), read by this package.

Declared here, beside the code that reads them, and composed into the one configuration by
:mod:`weightcast.runtime.config`, so that the core install's CLI parses, checks and documents
them without the trainer's dependencies: this module imports nothing but the declaration
helpers (an import-linter contract keeps it so). torchtitan's own job-config sections come as
``[trainer.<section>]`` tables (``titan``), applied by
:func:`weightcast_trainer.job.build_job_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from weightcast.runtime.spec import metrics_port, setting

MODELS = ("tiny", "small", "debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
MOE_MODELS = ("tiny-moe", "debugmodel_moe", "30B-A3B", "235B-A22B")
"""The Qwen3 flavors the trainer builds, dense (``MODELS``) and mixtures of experts
(``MOE_MODELS``): weightcast's ``tiny``, ``small`` and ``tiny-moe`` and torchtitan 0.2.0's
own (a test checks these lists against the trainer's registry)."""

LOSS = re.compile(r"^(grpo|sft|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")


@dataclass
class TrainerConfig:
    COMMANDS: ClassVar[tuple[str, ...]] = ("trainer",)

    model: str = setting(
        "tiny",
        "Qwen3 flavor to build with random weights; with init_from the checkpoint's config.json "
        "gives the shape, and a model given too must agree with it",
        flag="--model",
        choices=MODELS + MOE_MODELS,
        commands=("trainer", "up"),
    )
    init_from: str = setting(
        "",
        "start a fresh run from this Hugging Face checkpoint directory (config.json and "
        "model.safetensors or shards, as save_pretrained writes them; Qwen3 or Qwen3-MoE, "
        "bf16, fp16 or fp32); a run that finds a resume checkpoint resumes from it instead",
        flag="--init-from",
        commands=("trainer", "up"),
    )
    steps: int = setting(
        0, "optimizer steps to train before exiting; 0 trains until stopped", flag="--steps", ge=0
    )
    publish_every: int = setting(1, "write a snapshot every K steps", flag="--publish-every", ge=1)
    seq_len: int = setting(
        256,
        "longest batch accepted, in tokens (torchtitan's training.seq_len)",
        flag="--seq-len",
        ge=2,
    )
    loss: str = setting(
        "grpo",
        "grpo, sft, or a function of your own as package.module:function",
        flag="--loss",
        pattern=LOSS,
        pattern_text="grpo, sft or package.module:function",
    )
    clip_eps: float = setting(
        0.2,
        "PPO-style clipping of the importance ratio to [1-eps, 1+eps]",
        flag="--clip-eps",
        ge=0,
        le=1,
    )
    lr: float = setting(
        8e-4, "the optimizer's peak learning rate (after warm-up)", flag="--lr", gt=0
    )
    kl_coef: float = setting(
        0.0,
        "weight of the k3 KL to the reference log-probabilities",
        flag="--kl-coef",
        ge=0,
        le=10,
    )
    dual_clip: float = setting(
        3.0,
        "dual-clip PPO: with a negative advantage A the per-token objective never falls below "
        "dual_clip * A, however far the policy moved from old_logprobs",
        flag="--dual-clip",
        gt=1,
        le=100,
    )
    micro_batches: int = setting(
        1,
        "stream entries accumulated into one optimizer step, per DP rank",
        flag="--micro-batches",
        ge=1,
    )
    max_policy_lag: int = setting(
        8,
        "drop (count, acknowledge) batches whose policy_version is more than this many "
        "published versions behind the latest; a negative value keeps every batch",
        flag="--max-policy-lag",
    )
    mismatch_memory_mb: float = setting(
        4096.0,
        "host memory per rank for the bf16 weights of the newest published steps, against "
        "which batches of any policy lag are scored for the train/inference mismatch "
        "(mismatch_kl); 0 scores batches of lag 0 only",
        flag="--mismatch-memory-mb",
        ge=0,
    )
    resume_dir: str = setting(
        "",
        "resume checkpoints (model, optimizer, LR schedule, train state); empty means "
        "<checkpoint_dir>-resume, beside the snapshots and outside the publisher's scan",
        flag="--resume-dir",
    )
    max_attempts: int = setting(
        5,
        "dead-letter an entry after this many failed attempts: steps that trained it and "
        "never finished because the trainer died or raised (restarts and re-deliveries count "
        "nothing)",
        flag="--max-attempts",
        ge=1,
    )
    dead_letters_kept: int = setting(
        10_000,
        "the dead-letter stream keeps its newest this many entries (each holds a whole "
        "batch); 0 keeps every one",
        ge=0,
    )
    claim_idle_s: float = setting(
        300.0,
        "claim entries another consumer left pending this long; keep it above the time "
        "between reading an entry and the resume checkpoint that holds it",
        flag="--claim-idle-s",
        gt=0,
    )
    trim_stream: bool = setting(
        True,
        "after each resume checkpoint, delete the stream entries every consumer group has "
        "acknowledged, so a long run does not grow Redis; false keeps them (replay, audit)",
        flag="--trim-stream",
    )
    applied_history: int = setting(
        100_000,
        "applied stream ids kept in the train state (ids since the last checkpoint always)",
        ge=0,
    )
    consumer: str = setting(
        "",
        "consumer name in the trainer group; empty means the host name, so that a restarted "
        "trainer finds its own pending entries (-dp<R> is added per DP rank)",
        flag="--consumer",
    )
    run_id: str = setting(
        "",
        "identifies this training run in snapshots and versions; empty means the resumed "
        "checkpoint's, or a fresh one",
        flag="--run-id",
        pattern=re.compile(r"^[\w.-]{0,64}$"),
        pattern_text="at most 64 letters, digits, '_', '.' or '-'",
    )
    block_ms: int = setting(1000, "longest wait for a batch in one XREADGROUP, in ms", ge=1)
    seed: int = setting(0, "torchtitan's training seed")
    metrics_port: int = metrics_port("Prometheus /metrics and /healthz")
    titan: dict[str, dict[str, Any]] = setting(
        help="torchtitan job config overrides by section ([trainer.optimizer]...)", factory=dict
    )
