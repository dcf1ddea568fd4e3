"""What the publisher's loop shares with its publish and its housekeeping."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis

from weightcast.contract.keys import Keys
from weightcast.runtime.retry import Outage
from weightcast.runtime.stop import StopRequest
from weightcast.store.factory import PublisherStore
from weightcast_publisher.leader import LeaderLock
from weightcast_publisher.metrics import PublisherMetrics
from weightcast_publisher.registry import Registry
from weightcast_publisher.settings import PublisherConfig


@dataclass(frozen=True, kw_only=True)
class PublisherContext:
    """The publisher's settings, directories and store, its Redis records and lock, its
    metrics, and how it rides out an outage and hears a stop: built once by
    :class:`~weightcast_publisher.daemon.Publisher`, read by
    :class:`~weightcast_publisher.publishing.Publishing` and
    :class:`~weightcast_publisher.housekeeping.Housekeeping`."""

    cfg: PublisherConfig
    checkpoint_dir: Path
    weights_dir: Path
    store: PublisherStore
    """Where versions are written, read back from and removed: the weights directory, or that
    directory mirrored to the bucket nodes read (the next delta's base stays here)."""
    redis: redis.Redis
    keys: Keys
    registry: Registry
    lock: LeaderLock
    metrics: PublisherMetrics
    outage: Outage
    """The back-off of a Redis outage, within ``redis_retry_seconds``."""
    stopping: StopRequest
    """Set by SIGTERM / SIGINT (a flag: see :mod:`weightcast.runtime.stop`) or ``stop()``."""
