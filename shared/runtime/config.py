"""Layered configuration: defaults < TOML file < ``WEIGHTCAST_*`` environment < command line.

Settings are plain dataclasses, one section per process, each setting declared once with
:func:`setting`: its default, what it means, its bounds and its command-line flag. From that
one declaration come the flags of every command (:func:`add_flags`), the bounds check
(:func:`validate`, run by :func:`load_config` on the merged result) and the reference page
``docs/configuration.md`` (:func:`reference_markdown`; a test fails when the page is stale).

A setting has a dotted name: ``redis_url`` (common, top level of the TOML file),
``trainer.publish_every`` (the ``[trainer]`` table), and so on. Its environment variable is
that name in upper case with ``_`` for ``.``, prefixed with ``WEIGHTCAST_``:
``WEIGHTCAST_REDIS_URL``, ``WEIGHTCAST_TRAINER_PUBLISH_EVERY``. The trainer also takes
torchtitan's job config sections as sub-tables (``[trainer.optimizer]``,
``[trainer.training]``...), checked and applied by the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import tomllib
import typing
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightcast.contract.errors import ConfigError
from weightcast.contract.keys import NAMESPACE_PATTERN
from weightcast.contract.layout import LAYOUTS
from weightcast.contract.manifest import DEFAULT_DIGEST, DIGESTS

ENV_PREFIX = "WEIGHTCAST_"

COMMANDS = ("up", "trainer", "publisher", "produce", "follow", "status")

MODELS = ("tiny", "small", "debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B")
"""The dense Qwen3 flavors the trainer builds: weightcast's ``tiny`` and ``small`` and
torchtitan 0.2.0's own (a test checks this list against the trainer's registry)."""

READERS = ("auto", "dcp-load")
PAUSE_MODES = ("wait", "abort")
ROLLOUT_ENGINES = ("transformers", "vllm")
VLLM_VENV_PYTHON = Path(".venv-vllm/bin/python")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_URL = re.compile(r"^(redis|rediss|unix)://")
LOSS = re.compile(r"^(grpo|sft|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
CHECKPOINT_DIR = Path("checkpoints")
WEIGHTS_DIR = Path("weights")
UP_WORKDIR = Path(".weightcast/runs")


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
    redis_retry_seconds: float = setting(
        300.0,
        "how long a process rides out an unreachable Redis (retrying with capped exponential "
        "back-off, /healthz 503 meanwhile) before it gives up with an error",
        flag="--redis-retry-seconds",
        ge=0,
    )
    log_format: str = setting("text", "log line format", flag="--log-format", choices=LOG_FORMATS)
    log_level: str = setting("INFO", "lowest level logged", flag="--log-level", choices=LOG_LEVELS)


@dataclass
class TrainerConfig:
    model: str = setting("tiny", "Qwen3 flavor", flag="--model", choices=MODELS)
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
    kl_coef: float = setting(
        0.0, "weight of the k3 KL to the reference log-probabilities", flag="--kl-coef", ge=0
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
    metrics_port: int = setting(
        0,
        "serve Prometheus /metrics and /healthz on this port; 0 keeps it off",
        flag="--metrics-port",
        ge=0,
        le=65535,
    )
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
    metrics_port: int = setting(
        0,
        "serve Prometheus /metrics and /healthz on this port; 0 keeps it off",
        flag="--metrics-port",
        ge=0,
        le=65535,
    )
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
    metrics_port: int = setting(
        0,
        "serve /healthz on this port (503 while Redis is unreachable or full); 0 keeps it off",
        flag="--metrics-port",
        ge=0,
        le=65535,
    )
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
    vllm_python: str = setting(
        "",
        "the Python that runs the rollout node with --engine vllm (vLLM and weightcast "
        f"installed); empty means {VLLM_VENV_PYTHON} when it exists (make vllm-setup)",
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
    "common": COMMANDS,
    "up": ("up",),
    "trainer": ("trainer",),
    "publisher": ("publisher",),
    "produce": ("produce",),
    "follow": ("follow",),
    "rollout": ("follow",),
}
_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("common", "sources"))


@dataclass(frozen=True)
class Setting:
    """One declared setting: its dotted name, section, type, default and :class:`Spec`."""

    name: str
    section: str
    key: str
    kind: type
    default: Any
    spec: Spec

    @property
    def env_var(self) -> str:
        return env_var(self.name)

    @property
    def commands(self) -> tuple[str, ...]:
        return self.spec.commands or SECTION_COMMANDS[self.section]


def settings() -> dict[str, Setting]:
    """Every setting by dotted name, in declaration order."""
    found: dict[str, Setting] = {}
    for section in dataclasses.fields(Config):
        if section.name == "sources":
            continue
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for fld in dataclasses.fields(cls):
            name = fld.name if section.name == "common" else f"{section.name}.{fld.name}"
            kind = typing.get_origin(hints[fld.name]) or hints[fld.name]
            default = getattr(defaults, fld.name)
            found[name] = Setting(name, section.name, fld.name, kind, default, fld.metadata["spec"])
    return found


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from its layers and check every bound; raises ConfigError."""
    config = Config()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        _apply_toml(config, table, str(path))
    env = os.environ if env is None else env
    known = settings()
    for item in known.values():
        if item.env_var in env:
            source = f"${item.env_var}"
            _set(config, item, _coerce(env[item.env_var], item.kind, source), source)
    for name, value in (overrides or {}).items():
        if value is not None:
            item = known[name]
            _set(config, item, value, config.sources.get(name) or item.spec.flag or name)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Check every setting against its bounds; the first breach is a :class:`ConfigError`."""
    for name, item in settings().items():
        value = getattr(getattr(config, item.section), item.key)
        problem = _breach(item, value)
        if problem:
            source = config.sources.get(name)
            where = f" (from {source})" if source else ""
            raise ConfigError(f"{name}{where} {problem}")


def _breach(item: Setting, value: Any) -> str:
    """What is wrong with ``value`` for ``item``, or ''."""
    spec = item.spec
    if spec.ge is not None and value < spec.ge:
        return f"must be >= {spec.ge:g}, got {value!r}"
    if spec.gt is not None and value <= spec.gt:
        return f"must be > {spec.gt:g}, got {value!r}"
    if spec.le is not None and value > spec.le:
        return f"must be <= {spec.le:g}, got {value!r}"
    if spec.choices and value not in spec.choices:
        return f"must be one of {', '.join(spec.choices)}; got {value!r}"
    if spec.pattern and not spec.pattern.match(str(value)):
        return f"must be {spec.pattern_text}; got {value!r}"
    if spec.power_of_two and value & (value - 1):
        return f"must be a power of two; got {value!r}"
    return ""


def env_var(name: str) -> str:
    """The environment variable that sets the dotted setting ``name``."""
    return ENV_PREFIX + name.upper().replace(".", "_")


def add_flags(parser: argparse.ArgumentParser, command: str, skip: Sequence[str] = ()) -> None:
    """Add the flag of every setting ``command`` takes (absent flags leave lower layers)."""
    for item in settings().values():
        if item.spec.flag is None or command not in item.commands or item.name in skip:
            continue
        extra: dict[str, Any]
        if item.kind is bool:
            extra = {"action": argparse.BooleanOptionalAction}
        else:
            extra = {"type": item.kind, "metavar": item.key.upper()}
        if item.spec.choices:
            extra["metavar"] = "{" + ",".join(item.spec.choices) + "}"
        bounds = f"; {item.spec.bounds()}" if item.spec.bounds() else ""
        parser.add_argument(
            item.spec.flag,
            dest=item.name,
            default=argparse.SUPPRESS,
            help=f"{item.spec.help} (default: {item.default}{bounds}; env {item.env_var})",
            **extra,
        )


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, by dotted name."""
    known = settings()
    return {k: v for k, v in vars(args).items() if k in known}


def reference_markdown() -> str:
    """``docs/configuration.md``: every setting with its default, bounds, flag and variable."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings' declarations in `shared/runtime/config.py` "
        "(`python scripts/gen_config_docs.py`); a test fails when this page is stale.",
        "",
        "Settings come from, in rising precedence: defaults, a TOML file (`--config`), "
        "`WEIGHTCAST_*` environment variables, command-line flags. Every value is checked "
        "against its bounds before any work starts; a value out of bounds is one line naming "
        "the setting and where it came from, and exit status 2.",
    ]
    by_section: dict[str, list[Setting]] = {}
    for item in settings().values():
        by_section.setdefault(item.section, []).append(item)
    for section, items in by_section.items():
        table = "top level of the TOML file" if section == "common" else f"`[{section}]`"
        commands = ", ".join(f"`{c}`" for c in SECTION_COMMANDS[section])
        lines += ["", f"## {section} ({table}; commands {commands})", ""]
        lines += ["| setting | default | bounds | flag | meaning |", "|---|---|---|---|---|"]
        for item in items:
            flag = f"`{item.spec.flag}`" if item.spec.flag else ""
            if item.spec.commands:
                flag += f" ({', '.join(item.spec.commands)})"
            default = "" if item.default in ("", {}) else f"`{item.default}`"
            lines.append(
                f"| `{item.name}` | {default} | {item.spec.bounds()} | {flag} | {item.spec.help} |"
            )
    lines += [
        "",
        "Each setting's environment variable is its dotted name in capitals with `_` for "
        "`.`, after `WEIGHTCAST_`: `trainer.publish_every` is "
        "`WEIGHTCAST_TRAINER_PUBLISH_EVERY`. The trainer also takes torchtitan's job-config "
        "sections as `[trainer.<section>]` tables (`optimizer`, `lr_scheduler`, `training`, "
        "`parallelism`, `checkpoint`...); unknown names are refused.",
        "",
    ]
    return "\n".join(lines)


def resume_dir(config: Config) -> Path:
    """``trainer.resume_dir``, or ``<checkpoint_dir>-resume`` beside the snapshots."""
    if config.trainer.resume_dir:
        return Path(config.trainer.resume_dir).absolute()
    snapshots = Path(config.common.checkpoint_dir).absolute()
    return snapshots.with_name(f"{snapshots.name}-resume")


def writable_dirs(config: Config, command: str) -> dict[str, Path]:
    """The directories ``command`` writes, by setting name (checked before it starts)."""
    common = config.common
    if command == "trainer":
        return {"checkpoint_dir": common.checkpoint_dir, "trainer.resume_dir": resume_dir(config)}
    if command == "publisher":
        return {"checkpoint_dir": common.checkpoint_dir, "weights_dir": common.weights_dir}
    if command == "up":
        return {"up.workdir": config.up.workdir}
    return {}


def check_writable_dir(path: Path, name: str) -> None:
    """Create ``path`` if needed and prove it writable (a real write: root ignores modes)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name} {path} is not a directory")
    probe = path / f".weightcast-probe-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{name} {path} is not writable: {exc.strerror or exc}") from None


def _apply_toml(config: Config, table: Mapping[str, Any], source: str) -> None:
    known = settings()
    for key, value in table.items():
        if key in _SECTIONS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if key == "trainer" and isinstance(sub_value, Mapping):
                    config.trainer.titan.setdefault(sub, {}).update(sub_value)
                elif name in known and known[name].kind is not dict:
                    where = f"{source}: {name}"
                    _set(config, known[name], _coerce(sub_value, known[name].kind, where), where)
                else:
                    raise ConfigError(f"{source}: unknown setting {name!r}")
        elif key in known:
            where = f"{source}: {key}"
            _set(config, known[key], _coerce(value, known[key].kind, where), where)
        else:
            top = sorted(k for k in known if "." not in k) + [f"[{s}]" for s in _SECTIONS]
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(top)}")


def _set(config: Config, item: Setting, value: Any, source: str) -> None:
    if item.name == "log_level" and isinstance(value, str):
        value = value.upper()
    setattr(getattr(config, item.section), item.key, value)
    config.sources[item.name] = source


def _coerce(value: Any, kind: type, source: str) -> Any:
    """Convert a TOML or environment value to the setting's type."""
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if kind is int and isinstance(value, float | bool):
            raise ValueError(f"not an integer: {value!r}")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def default_node_id() -> str:
    """``<hostname>-<pid>``: what names this process when no node id or producer name is set."""
    return f"{socket.gethostname()}-{os.getpid()}"
