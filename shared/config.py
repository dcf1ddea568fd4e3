"""Layered configuration: defaults < TOML file < ``WEIGHTCAST_*`` environment < command line.

Settings are plain dataclasses, one per process, each addressed by a dotted name:
``redis_url`` (common, top level of the TOML file), ``trainer.publish_every`` (the
``[trainer]`` table), and so on. The environment variable of a setting is its dotted name in
upper case with ``_`` for ``.``, prefixed with ``WEIGHTCAST_``: ``WEIGHTCAST_REDIS_URL``,
``WEIGHTCAST_TRAINER_PUBLISH_EVERY``. The trainer also takes torchtitan's job config sections
as sub-tables (``[trainer.optimizer]``, ``[trainer.training]``...), applied by the trainer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "WEIGHTCAST_"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and its source."""


@dataclass
class CommonConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "wc"
    checkpoint_dir: Path = Path("checkpoints")
    weights_dir: Path = Path("weights")
    log_format: str = "text"
    log_level: str = "INFO"


@dataclass
class TrainerConfig:
    model: str = "tiny"
    steps: int = 0
    """Optimizer steps to train before exiting; 0 trains until stopped."""
    publish_every: int = 1
    seq_len: int = 256
    """Longest batch accepted, in tokens (torchtitan's ``training.seq_len``)."""
    loss: str = "grpo"
    """``grpo``, ``sft``, or a user's ``"package.module:function"``."""
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    micro_batches: int = 1
    """Stream entries (micro-batches) accumulated into one optimizer step, per DP rank."""
    max_policy_lag: int = 8
    """Drop (count, ack) batches whose ``policy_version`` is more than this many published
    versions behind ``{wc}:weights:latest``; a negative value keeps every batch."""
    resume_dir: str = ""
    """Resume checkpoints (model, optimizer, LR schedule, train state); empty means
    ``<checkpoint_dir>-resume``, beside the snapshots and outside the publisher's scan."""
    max_deliveries: int = 5
    """Dead-letter an entry delivered more often than this (it keeps crashing trainers)."""
    dead_letters_kept: int = 10_000
    """The dead-letter stream keeps its newest this many entries (each holds a whole batch);
    0 keeps every one."""
    claim_idle_s: float = 300.0
    """Claim entries another consumer left pending this long; keep it above the time
    between reading an entry and the resume checkpoint that holds it."""
    trim_stream: bool = True
    """After each resume checkpoint, delete the stream entries every consumer group has
    acknowledged, so a long run does not grow Redis; false keeps them (replay, audit)."""
    applied_history: int = 100_000
    """Applied stream ids kept in the train state (ids since the last checkpoint always)."""
    consumer: str = ""
    """Consumer name in the ``trainer`` group; empty means the host name, so that a
    restarted trainer finds its own pending entries (``-dp<R>`` is added per DP rank)."""
    run_id: str = ""
    """Identifies this training run in snapshots and versions; empty means the resumed
    checkpoint's, or a fresh one."""
    block_ms: int = 1000
    seed: int = 0
    metrics_port: int = 0
    """Serve Prometheus ``/metrics`` and ``/healthz`` on this port; 0 keeps it off."""
    titan: dict[str, dict[str, Any]] = field(default_factory=dict)
    """torchtitan job config overrides by section (``optimizer``, ``lr_scheduler``...)."""


@dataclass
class PublisherConfig:
    tp: int = 1
    keep: int = 2
    rescan_seconds: float = 5.0
    poll: bool = False
    """Use watchdog's PollingObserver (for NFS and other network filesystems)."""
    once: bool = False
    """Publish what is complete at start, then exit (for scripts and tests)."""
    metrics_port: int = 0
    """Serve Prometheus ``/metrics`` and ``/healthz`` on this port; 0 keeps it off."""
    layout: str = "vllm-fused"
    """``vllm-fused``, ``hf`` (plain HF shards + index) or ``both`` (HF in ``v<N>/hf/``)."""
    per_rank_files: bool = False
    """With tp > 1, one safetensors file per rank holding exactly that rank's parameters."""
    reader: str = "auto"
    """``auto``: copy byte ranges out of DCP files when possible; ``dcp-load``: always load."""
    leader_ttl_seconds: float = 10.0
    """TTL of the publisher lock; a standby takes over within it when the leader dies."""
    retry_max_seconds: float = 30.0
    """Longest back-off between retries after a Redis outage or a full disk."""
    keep_quarantined: int = 5
    """Quarantined snapshots kept on disk (newest first); older ones are deleted."""


@dataclass
class ProduceConfig:
    count: int = 1
    batch_size: int = 4
    seq_len: int = 64
    vocab_size: int = 1024
    interval: float = 0.0
    """Seconds to wait between batches (paces a demo like a real rollout fleet)."""
    invalid_every: int = 0
    """Push a malformed batch after every N good ones (0: never); shows the dead-letter path."""
    seed: int = 0
    max_pending: int = 16
    """Back-pressure: wait while this many batches are undelivered to the trainer (0: never)."""
    timeout: float = 300.0
    """Give up (and exit 1) when the trainer has not made room for this many seconds."""


@dataclass
class FollowConfig:
    node_id: str = ""
    """Name in ``{wc}:nodes``; empty means ``<hostname>-<pid>``."""
    poll_seconds: float = 2.0
    lease_seconds: float = 30.0
    until_version: int = 0
    """Exit once this version (or a newer one) is loaded; 0 follows forever."""
    stale_seconds: float = 60.0
    """``weightcast status`` marks a node stale when it has not reported for this long."""
    rollout: bool = False
    """Also be the rollout producer: sample from the loaded version and push scored batches."""


@dataclass
class RolloutConfig:
    """The toy RL task of ``weightcast follow --rollout`` (and ``weightcast up``).

    Each batch is ``prompts`` random prompts of ``prompt_len`` tokens, each sampled
    ``group_size`` times for ``completion_len`` tokens (a GRPO group). The reward of a
    completion is the fraction of its tokens below ``target_below``: learnable from a
    near-uniform start, checkable by anyone.
    """

    prompts: int = 4
    group_size: int = 8
    prompt_len: int = 8
    completion_len: int = 16
    target_below: int = 32
    vocab_size: int = 1024
    """Only for version 0 (nothing published yet): the uniform policy over this many ids."""
    max_pending: int = 2
    """Back-pressure: keep the rollouts at most this many batches ahead of the trainer."""
    timeout: float = 600.0
    seed: int = 0


@dataclass
class Config:
    common: CommonConfig = field(default_factory=CommonConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    publisher: PublisherConfig = field(default_factory=PublisherConfig)
    produce: ProduceConfig = field(default_factory=ProduceConfig)
    follow: FollowConfig = field(default_factory=FollowConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


_SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "common")


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from its layers; raises :class:`ConfigError`."""
    config = Config()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        _apply_toml(config, table, str(path))
    env = os.environ if env is None else env
    for name, (section, fld) in _settings().items():
        var = env_var(name)
        if var in env:
            _set(config, name, _coerce(env[var], _field_type(section, fld), f"${var}"))
    for name, value in (overrides or {}).items():
        if value is not None:
            _set(config, name, value)
    return config


def env_var(name: str) -> str:
    """The environment variable that sets the dotted setting ``name``."""
    return ENV_PREFIX + name.upper().replace(".", "_")


def add_flag(parser: argparse.ArgumentParser, name: str, *flags: str, help: str = "") -> None:
    """Add a command-line flag for setting ``name``; absent flags leave lower layers alone."""
    section, fld = _settings()[name]
    kind = _field_type(section, fld)
    extra: dict[str, Any]
    if kind is bool:
        extra = {"action": argparse.BooleanOptionalAction}
    else:
        extra = {"type": kind, "metavar": fld.name.upper()}
    default = getattr(section(), fld.name)
    parser.add_argument(
        *flags,
        dest=name,
        default=argparse.SUPPRESS,
        help=f"{help} (default: {default}; env {env_var(name)})",
        **extra,
    )


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, by dotted name."""
    names = _settings()
    return {k: v for k, v in vars(args).items() if k in names}


def _settings() -> dict[str, tuple[type, dataclasses.Field[Any]]]:
    settings: dict[str, tuple[type, dataclasses.Field[Any]]] = {}
    for fld in dataclasses.fields(CommonConfig):
        settings[fld.name] = (CommonConfig, fld)
    for section in dataclasses.fields(Config):
        if section.name == "common":
            continue
        cls = section.default_factory  # type: ignore[misc]
        for fld in dataclasses.fields(cls):
            if fld.name != "titan":
                settings[f"{section.name}.{fld.name}"] = (cls, fld)
    return settings


def _apply_toml(config: Config, table: Mapping[str, Any], source: str) -> None:
    settings = _settings()
    for key, value in table.items():
        if key in _SECTIONS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if key == "trainer" and isinstance(sub_value, Mapping):
                    config.trainer.titan.setdefault(sub, {}).update(sub_value)
                elif name in settings:
                    cls, fld = settings[name]
                    kind = _field_type(cls, fld)
                    _set(config, name, _coerce(sub_value, kind, f"{source}: {name}"))
                else:
                    raise ConfigError(f"{source}: unknown setting {name!r}")
        elif key in settings:
            cls, fld = settings[key]
            _set(config, key, _coerce(value, _field_type(cls, fld), f"{source}: {key}"))
        else:
            known = sorted(k for k in settings if "." not in k) + [f"[{s}]" for s in _SECTIONS]
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(known)}")


def _set(config: Config, name: str, value: Any) -> None:
    section, _, key = name.rpartition(".")
    setattr(getattr(config, section or "common"), key, value)


def _field_type(cls: type, fld: dataclasses.Field[Any]) -> type:
    return typing.get_type_hints(cls)[fld.name]


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
        if kind is int and isinstance(value, float):
            raise ValueError(f"not an integer: {value!r}")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def default_node_id() -> str:
    """``<hostname>-<pid>``: what names this process when no node id or producer name is set."""
    return f"{socket.gethostname()}-{os.getpid()}"
