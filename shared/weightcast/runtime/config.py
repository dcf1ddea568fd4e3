"""Every setting of every process, declared once: the seven sections and their bounds.

Settings are plain dataclasses, one section per process, each setting declared once with
:func:`setting`: its default, what it means, its bounds and its command-line flag. How they
are loaded, checked, turned into flags and documented is :mod:`weightcast.runtime.settings`.

A setting has a dotted name: ``redis_url`` (common, top level of the TOML file),
``trainer.publish_every`` (the ``[trainer]`` table), and so on. The trainer also takes
torchtitan's job config sections as sub-tables (``[trainer.optimizer]``,
``[trainer.training]``...), checked and applied by the trainer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from weightcast.contract.fp8 import QUANTIZE_CHOICES
from weightcast.contract.keys import NAMESPACE_PATTERN
from weightcast.contract.layout import LAYOUTS
from weightcast.contract.manifest import DEFAULT_DIGEST, DIGESTS

COMMANDS = {
    "up": "run the whole pipeline locally (private redis-server, tiny model, CPU) and exit",
    "trainer": "train on rollout batches from Redis and write snapshots (torchrun works)",
    "publisher": "publish complete snapshots as vllm-fused versions and evict old ones",
    "produce": "push synthetic rollout batches (a stand-in rollout producer)",
    "follow": "a reference inference node: lease, verify and load each new version",
    "status": "show versions, leases, nodes, the trainer and the batch queue",
}
"""Every ``weightcast`` command and what it does (its ``--help`` line)."""

MODELS = ("tiny", "small", "debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
MOE_MODELS = ("tiny-moe", "debugmodel_moe", "30B-A3B", "235B-A22B")
"""The Qwen3 flavors the trainer builds, dense (``MODELS``) and mixtures of experts
(``MOE_MODELS``): weightcast's ``tiny``, ``small`` and ``tiny-moe`` and torchtitan 0.2.0's
own (a test checks these lists against the trainer's registry)."""

READERS = ("auto", "dcp-load")
PAUSE_MODES = ("wait", "abort")
ROLLOUT_ENGINES = ("transformers", "vllm")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_URL = re.compile(r"^(redis|rediss|unix)://")
S3_URL = re.compile(r"^(|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^?#@]*)?)$")
HTTP_URL = re.compile(r"^(|https?://[^\s@]+)$")
LOSS = re.compile(r"^(grpo|sft|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
CHECKPOINT_DIR = Path("checkpoints")
WEIGHTS_DIR = Path("weights")
UP_WORKDIR = Path(".weightcast/runs")
UP_STORES = ("directory", "s3")


@dataclass(frozen=True)
class Spec:
    """What a setting declares besides its default (kept in the dataclass field's metadata)."""

    help: str
    flag: str | None = None
    commands: tuple[str, ...] | None = None
    """Commands that take the flag; None means every command of the setting's section."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    pattern_text: str = ""
    """What ``pattern`` asks for, in words, for the error message and the docs."""
    power_of_two: bool = False

    def bounds(self) -> str:
        """The bounds in words, for ``--help`` and the reference page."""
        parts = []
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        if self.choices:
            parts.append("one of " + ", ".join(self.choices))
        if self.pattern_text:
            parts.append(self.pattern_text)
        if self.power_of_two:
            parts.append("a power of two")
        return "; ".join(parts)


def setting(default: Any = None, help: str = "", *, factory: Any = None, **spec: Any) -> Any:
    """Declare a setting: its default (or ``factory`` for a mutable one), meaning, bounds
    (``ge``, ``gt``, ``le``, ``choices``, ``pattern``/``pattern_text``, ``power_of_two``) and
    flag (``flag``, ``commands``)."""
    metadata = {"spec": Spec(help, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def metrics_port(serves: str) -> Any:
    """The ``metrics_port`` setting of a daemon that serves ``serves`` (each has its own)."""
    return setting(
        0,
        f"serve {serves} on this port; 0 keeps it off",
        flag="--metrics-port",
        ge=0,
        le=65535,
    )


@dataclass
class CommonConfig:
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0",
        "Redis to use",
        flag="--redis-url",
        commands=("trainer", "publisher", "produce", "follow", "status"),
        pattern=REDIS_URL,
        pattern_text="a redis://, rediss:// or unix:// URL",
    )
    namespace: str = setting(
        "wc",
        "key namespace (the Redis hash tag of every key)",
        flag="--namespace",
        pattern=re.compile(NAMESPACE_PATTERN),
        pattern_text="1-64 letters, digits, '_', '.' or '-'",
    )
    checkpoint_dir: Path = setting(
        CHECKPOINT_DIR,
        "where the trainer writes snapshots and the publisher reads them",
        flag="--checkpoint-dir",
        commands=("trainer", "publisher", "produce", "follow", "status"),
    )
    weights_dir: Path = setting(
        WEIGHTS_DIR,
        "where the publisher writes versions and inference nodes read them",
        flag="--weights-dir",
        commands=("trainer", "publisher", "produce", "follow", "status"),
    )
    weights_url: str = setting(
        "",
        "an s3://bucket/prefix URL: versions live in that bucket (any S3-compatible server), "
        "weights_dir stays the publisher's local copy and nodes need no view of it; empty: "
        "versions live in weights_dir. Credentials come from the AWS environment or profile",
        flag="--weights-url",
        commands=("publisher", "follow"),
        pattern=S3_URL,
        pattern_text="empty, or an s3://bucket/prefix URL (no credentials, no query)",
    )
    s3_endpoint_url: str = setting(
        "",
        "the S3-compatible server of weights_url (http://host:port); empty: AWS, or "
        "AWS_ENDPOINT_URL",
        flag="--s3-endpoint-url",
        commands=("publisher", "follow"),
        pattern=HTTP_URL,
        pattern_text="empty, or an http:// or https:// URL",
    )
    s3_region: str = setting(
        "",
        "the region of weights_url's bucket; empty: AWS_REGION or the AWS profile's",
        flag="--s3-region",
        commands=("publisher", "follow"),
    )
    s3_addressing_style: str = setting(
        "auto",
        "how requests name the bucket: path (most S3-compatible servers), virtual, or auto",
        flag="--s3-addressing-style",
        commands=("publisher", "follow"),
        choices=("auto", "path", "virtual"),
    )
    store_retry_seconds: float = setting(
        60.0,
        "how long one call to the object store is retried through throttling, 5xx answers "
        "and lost connections (capped exponential back-off) before it counts as an outage",
        flag="--store-retry-seconds",
        commands=("publisher", "follow"),
        ge=1,
    )
    redis_retry_seconds: float = setting(
        300.0,
        "how long a process rides out an unreachable Redis (retrying with capped exponential "
        "back-off, /healthz 503 meanwhile) before it gives up with an error",
        flag="--redis-retry-seconds",
        ge=0,
    )
    log_format: str = setting("text", "log line format", flag="--log-format", choices=LOG_FORMATS)
    log_level: str = setting("INFO", "lowest level logged", flag="--log-level", choices=LOG_LEVELS)

    def weights_location(self) -> str:
        """Where nodes read versions: ``weights_url`` with the S3 settings as its options
        (one string a node hands its other processes), or ``weights_dir``."""
        if not self.weights_url:
            return str(self.weights_dir)
        options = {
            "endpoint_url": self.s3_endpoint_url,
            "region": self.s3_region,
            "addressing_style": ""
            if self.s3_addressing_style == "auto"
            else self.s3_addressing_style,
        }
        query = urlencode({k: v for k, v in options.items() if v})
        return f"{self.weights_url}?{query}" if query else self.weights_url


@dataclass
class TrainerConfig:
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


@dataclass
class PublisherConfig:
    tp: int = setting(
        1,
        "inference tensor-parallel degree the fused layout is cut for (vLLM splits Qwen3's 8 "
        "kv heads, so a tp that is not a power of two fits no released size)",
        flag="--tp",
        ge=1,
        le=512,
        power_of_two=True,
    )
    keep: int = setting(2, "versions to keep (plus any a reader leases)", flag="--keep", ge=1)
    rescan_seconds: float = setting(
        5.0, "rescan the checkpoint directory at least this often", flag="--rescan-seconds", gt=0
    )
    poll: bool = setting(
        False, "use watchdog's polling observer (NFS and other network filesystems)", flag="--poll"
    )
    once: bool = setting(
        False, "publish what is complete at start, then exit (scripts and tests)", flag="--once"
    )
    metrics_port: int = metrics_port("Prometheus /metrics and /healthz")
    layout: str = setting(
        "vllm-fused",
        "vllm-fused, hf (plain HF shards and index) or both (HF in v<N>/hf/)",
        flag="--layout",
        choices=LAYOUTS,
    )
    per_rank_files: bool = setting(
        False,
        "with tp > 1, one safetensors file per rank holding exactly that rank's parameters",
        flag="--per-rank-files",
    )
    expert_parallel: bool = setting(
        False,
        "mixtures of experts: lay experts out for vLLM's --enable-expert-parallel (whole "
        "experts per rank, ep = tp; tp must divide the experts) instead of splitting each "
        "expert's intermediate dimension over the tp ranks",
        flag="--expert-parallel",
    )
    quantize: str = setting(
        "none",
        "fp8: publish linear weights as block-scaled FP8 (e4m3, a float32 scale per 128x128 "
        "block, as the published Qwen3 FP8 checkpoints; embedding, norms, router and lm_head "
        "stay bf16) that vLLM serves with its FP8 kernels; none: as the snapshot holds them",
        flag="--quantize",
        commands=("publisher", "up"),
        choices=QUANTIZE_CHOICES,
    )
    reader: str = setting(
        "auto",
        "auto: copy byte ranges out of the snapshot's files (dcp-safetensors snapshots); "
        "dcp-load: load every snapshot with dcp.load (always the case for dcp-torchsave ones)",
        flag="--reader",
        choices=READERS,
    )
    digest: str = setting(
        DEFAULT_DIGEST,
        "per-block digest of published files: xxh3-128 catches corruption; blake3 (a "
        "cryptographic hash, pip install blake3) also resists tampering with the files",
        flag="--digest",
        choices=DIGESTS,
    )
    delta: bool = setting(
        True,
        "write beside each version a delta from the previous one (the changed bytes of each "
        "digest block, xor-sparse) when their layouts match; nodes that hold the previous "
        "version read only it",
        flag="--delta",
    )
    delta_max_ratio: float = setting(
        0.5,
        "stop encoding a version's delta (the version is published without one, the reason "
        "logged and registered) once it holds more than this fraction of the bytes it covers: "
        "a node would read nearly the whole version anyway, and the publisher pay the encoding",
        flag="--delta-max-ratio",
        gt=0,
        le=1,
    )
    delta_behind: str = setting(
        "auto",
        "what a delta whose encoding falls behind the write does: auto (the write waits for "
        "it while the waits stay within a third of the write's time: one node's read saved "
        "pays for that), drop (at once: the version is never later than without deltas) or "
        "wait (as long as it takes: every version keeps its delta, for many nodes or a "
        "bucket on other hosts)",
        flag="--delta-behind",
        choices=("auto", "drop", "wait"),
    )
    delta_window: int = setting(
        8,
        "delta-only versions kept beyond the `keep` full ones: an evicted version's full "
        "files go but its manifest, config and delta stay while it is among the newest this "
        "many, so a node several versions behind reads the chain of deltas instead of the "
        "version whole (0: evicted versions go whole, as before)",
        flag="--delta-window",
        ge=0,
        le=1024,
    )
    leader_ttl_seconds: float = setting(
        10.0,
        "TTL of the publisher lock; a standby takes over within it when the leader dies",
        flag="--leader-ttl-seconds",
        gt=0,
    )
    retry_max_seconds: float = setting(
        30.0,
        "longest back-off between retries after a Redis outage or a full disk",
        flag="--retry-max-seconds",
        gt=0,
    )
    keep_quarantined: int = setting(
        5,
        "quarantined snapshots kept on disk (newest first); older ones are deleted",
        flag="--keep-quarantined",
        ge=0,
    )
    keep_records: int = setting(
        1000,
        "records of handled and of quarantined snapshots kept in Redis (newest first); older "
        "ones are deleted",
        flag="--keep-records",
        ge=10,
    )
    node_retention_seconds: float = setting(
        86400.0,
        "a node that has not reported for this long is removed from {wc}:nodes (and status)",
        flag="--node-retention-seconds",
        ge=60,
    )


@dataclass
class ProduceConfig:
    count: int = setting(1, "batches to push", flag="--count", ge=0)
    batch_size: int = setting(4, "sequences per batch", flag="--batch-size", ge=1)
    seq_len: int = setting(64, "tokens per sequence", flag="--seq-len", ge=2)
    vocab_size: int = setting(1024, "token ids are below this", flag="--vocab-size", ge=1)
    interval: float = setting(
        0.0,
        "seconds to wait between batches (paces a demo like a real rollout fleet)",
        flag="--interval",
        ge=0,
    )
    invalid_every: int = setting(
        0,
        "also push a malformed batch after every N good ones (0: never); shows the "
        "dead-letter path",
        flag="--invalid-every",
        ge=0,
    )
    seed: int = setting(0, "random seed", flag="--seed")
    max_pending: int = setting(
        16,
        "back-pressure: wait while this many batches are undelivered to the trainer (0: never)",
        flag="--max-pending",
        ge=0,
    )
    timeout: float = setting(
        300.0,
        "give up (exit 1) when the trainer has not made room for this many seconds",
        flag="--timeout",
        gt=0,
    )


@dataclass
class FollowConfig:
    node_id: str = setting("", "name in {wc}:nodes; empty means <hostname>-<pid>", flag="--node-id")
    poll_seconds: float = setting(
        2.0, "re-read latest (and re-report the node) this often", flag="--poll-seconds", gt=0
    )
    lease_seconds: float = setting(30.0, "lease time to live", flag="--lease-seconds", gt=0)
    max_delta_chain: int = setting(
        16,
        "a node that keeps its base and is several versions behind applies at most this "
        "many deltas in a row (when together they are smaller than the version) before it "
        "reads the version whole; 1 applies only the delta from the version held",
        flag="--max-delta-chain",
        ge=1,
        le=1024,
    )
    until_version: int = setting(
        0,
        "exit once this version (or a newer one) is loaded; 0 follows forever",
        flag="--until-version",
        ge=0,
    )
    stale_seconds: float = setting(
        60.0,
        "weightcast status marks a node stale when it has not reported for this long",
        flag="--stale-seconds",
        commands=("status",),
        gt=0,
    )
    rollout: bool = setting(
        False,
        "also be the rollout producer: sample from the loaded version and push scored batches",
        flag="--rollout",
    )
    metrics_port: int = metrics_port("/healthz")
    vllm_url: str = setting(
        "",
        "keep the `vllm serve` at this URL on the newest version instead of loading versions "
        "here (the server runs the weightcast backend, with VLLM_SERVER_DEV_MODE=1)",
        flag="--vllm-url",
        pattern=re.compile(r"^(https?://\S+)?$"),
        pattern_text="empty, or an http:// or https:// URL",
    )
    vllm_weights_dir: str = setting(
        "",
        "the weights directory as the vLLM server's workers see it; empty means weights_dir",
        flag="--vllm-weights-dir",
    )
    vllm_timeout_seconds: float = setting(
        600.0,
        "longest wait for one call to the vLLM server (a pause waits for running requests)",
        flag="--vllm-timeout-seconds",
        gt=0,
    )
    vllm_pause_mode: str = setting(
        "wait",
        "how the vLLM server pauses for an update: wait lets running requests finish, abort "
        "ends them; either way its KV cache (old weights) is cleared",
        flag="--vllm-pause-mode",
        choices=PAUSE_MODES,
    )


@dataclass
class RolloutConfig:
    """The toy RL task of ``weightcast follow --rollout`` (and ``weightcast up``).

    Each batch is ``prompts`` random prompts of ``prompt_len`` tokens, each sampled
    ``group_size`` times for ``completion_len`` tokens (a GRPO group). The reward of a
    completion is the fraction of its tokens below ``target_below``: learnable from a
    near-uniform start, checkable by anyone.
    """

    prompts: int = setting(4, "prompts per batch", flag="--prompts", ge=1)
    group_size: int = setting(8, "completions per prompt (GRPO)", flag="--group-size", ge=2)
    prompt_len: int = setting(8, "prompt tokens", flag="--prompt-len", ge=1)
    completion_len: int = setting(16, "sampled tokens", flag="--completion-len", ge=1)
    target_below: int = setting(
        32, "rewarded token ids are below this", flag="--target-below", ge=1
    )
    vocab_size: int = setting(
        1024, "only for version 0 (nothing published yet): the uniform policy's vocabulary", ge=1
    )
    max_pending: int = setting(
        2,
        "back-pressure: keep the rollouts at most this many batches ahead of the trainer",
        flag="--max-pending",
        ge=0,
    )
    timeout: float = setting(
        600.0, "give up when the trainer has not made room for this many seconds", gt=0
    )
    seed: int = setting(0, "random seed of prompts and sampling", flag="--seed")
    engine: str = setting(
        "transformers",
        "what the rollout node samples with: transformers (fp32, in the node's process) or "
        "vllm (a vLLM engine on CPU or GPU, updated through the weightcast backend)",
        flag="--engine",
        commands=("up", "follow"),
        choices=ROLLOUT_ENGINES,
    )


@dataclass
class UpConfig:
    """``weightcast up``: the whole loop on one machine, for a fixed number of steps."""

    steps: int = setting(40, "training steps", flag="--steps", ge=1)
    publish_every: int = setting(2, "snapshot every K steps", flag="--publish-every", ge=1)
    workdir: Path = setting(UP_WORKDIR, "each run gets a directory here", flag="--workdir")
    timeout: float = setting(900.0, "give up after this many seconds", flag="--timeout", gt=0)
    lr: float = setting(
        1e-2,
        "the learning rate up gives its trainer unless trainer.lr is set (the tiny model then "
        "learns the toy task within the default steps)",
        flag="--lr",
        gt=0,
    )
    store: str = setting(
        "directory",
        "where versions go: directory (the run's weights directory, read by the node) or s3 "
        "(a private S3 server, SeaweedFS, from the s3-server extra; the node reads only the "
        "bucket)",
        flag="--store",
        choices=UP_STORES,
    )
    vllm_python: str = setting(
        "",
        "the Python that runs the rollout node with --engine vllm (vLLM and weightcast "
        "installed); empty means .venv-vllm/bin/python when it exists (make vllm-setup)",
        flag="--vllm-python",
    )


@dataclass
class Config:
    common: CommonConfig = field(default_factory=CommonConfig)
    up: UpConfig = field(default_factory=UpConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    publisher: PublisherConfig = field(default_factory=PublisherConfig)
    produce: ProduceConfig = field(default_factory=ProduceConfig)
    follow: FollowConfig = field(default_factory=FollowConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each setting that is not a default came from (a file, a variable, a flag)."""


SECTION_COMMANDS = {
    "common": tuple(COMMANDS),
    "up": ("up",),
    "trainer": ("trainer",),
    "publisher": ("publisher",),
    "produce": ("produce",),
    "follow": ("follow",),
    "rollout": ("follow",),
}
