"""The one configuration of every process, composed from the sections each role declares.

Each role declares its settings next to the code that reads them, with
:func:`~weightcast.runtime.spec.setting` (default, meaning, bounds, flag):

- the trainer's ``[trainer]`` in :mod:`weightcast_trainer.settings`;
- the publisher's ``[publisher]`` in :mod:`weightcast_publisher.settings`;
- an inference node's ``[follow]`` in :mod:`weightcast.client.settings`;
- ``[up]``, ``[produce]`` and ``[rollout]`` in :mod:`weightcast.local.settings`;
- the object store's (``weights_dir``, ``weights_url``, ``s3_*``...) in
  :mod:`weightcast.store.settings`, part of the common section;
- what every process reads (Redis, the namespace, logs) here, in :class:`ProcessSettings`.

:class:`Config` composes them: the one configuration that the command line, a TOML file and
the environment fill (:mod:`weightcast.runtime.settings`), so a setting keeps one dotted
name (``redis_url``, ``trainer.publish_every``...), one variable and one flag whichever role
reads it. The sections' modules import only the declaration helpers and the contract's names
(an import-linter contract keeps it so): composing them here takes none of a role's
dependencies into the core install.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from weightcast.client.settings import FollowConfig
from weightcast.contract.keys import NAMESPACE_PATTERN
from weightcast.local.settings import ProduceConfig, RolloutConfig, UpConfig
from weightcast.runtime.spec import setting
from weightcast.store.settings import StoreSettings
from weightcast_publisher.settings import PublisherConfig
from weightcast_trainer.settings import TrainerConfig

COMMANDS = {
    "up": "run the whole pipeline locally (private redis-server, tiny model, CPU) and exit",
    "trainer": "train on rollout batches from Redis and write snapshots (torchrun works)",
    "publisher": "publish complete snapshots as vllm-fused versions and evict old ones",
    "produce": "push synthetic rollout batches (a stand-in rollout producer)",
    "follow": "a reference inference node: lease, verify and load each new version",
    "status": "show versions, leases, nodes, the trainer and the batch queue",
}
"""Every ``weightcast`` command and what it does (its ``--help`` line)."""

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
REDIS_URL = re.compile(r"^(redis|rediss|unix)://")
CHECKPOINT_DIR = Path("checkpoints")


@dataclass
class ProcessSettings:
    """What every process reads: Redis, the key namespace, the snapshots, the logs."""

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
class CommonConfig(StoreSettings, ProcessSettings):
    """The top level of the TOML file: every process's settings, then the object store's."""

    COMMANDS: ClassVar[tuple[str, ...]] = tuple(COMMANDS)


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
    f.name: f.default_factory.COMMANDS  # type: ignore[misc]
    for f in fields(Config)
    if f.name != "sources"
}
"""The commands that read each section (and take its flags), as each section declares."""
