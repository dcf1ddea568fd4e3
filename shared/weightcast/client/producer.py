"""The rollout-producer side: push batches, validated with the trainer's own rules.

:class:`BatchProducer` validates each batch with :mod:`weightcast.contract.codec`, the code
the trainer decodes with, so a bad batch fails here with the reason the trainer would have
dead-lettered it for. Back-pressure: before adding an entry it waits while the ``trainer``
group has ``max_pending`` or more entries not yet delivered, and raises
:class:`BackPressureTimeout` if that lasts longer than ``timeout``. The producer never trims
the stream, so no unacknowledged batch is ever lost to it. :class:`AsyncBatchProducer` runs
the same producer's calls in worker threads, for asyncio code.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightcast.client.identity import default_node_id
from weightcast.contract.codec import BatchLimits, encode_batch
from weightcast.contract.errors import WeightcastError
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.streams import ensure_group
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.stop import Stop

_COUNT_AFTER = """
return #redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
"""
"""Entries after the group's last-delivered id, counted in Redis (no payload comes back)."""

_MAX_WAIT_STEP_S = 0.5

NO_LIMITS = BatchLimits()
"""Check everything but what only the trainer knows (vocab size, longest sequence)."""


class BackPressureTimeout(WeightcastError, TimeoutError):
    """The trainer did not take batches fast enough for ``push`` to add one in time."""


def _trainer_group(groups: Sequence[Mapping[str, Any]]) -> tuple[int | None, str] | None:
    """``(lag, last_delivered_id)`` of the ``trainer`` group in an XINFO GROUPS reply."""
    for group in groups:
        name = group["name"]
        if (name.decode() if isinstance(name, bytes) else name) == TRAINER_GROUP:
            last = group["last-delivered-id"]
            lag = group.get("lag")
            return (
                None if lag is None else int(lag),
                last.decode() if isinstance(last, bytes) else last,
            )
    return None


class BatchProducer:
    """Pushes micro-batches onto ``{wc}:batches``; a bad batch raises ``InvalidBatch`` here.

    ``max_pending`` bounds the undelivered entries (0: no bound); ``limits`` are what the
    trainer accepts (vocab size, sequence length), checked when given.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str = "wc",
        *,
        name: str = "",
        max_pending: int = 16,
        timeout: float = 300.0,
        limits: BatchLimits = NO_LIMITS,
        poll: float = 0.05,
    ) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending must be >= 0 (0 = unbounded), got {max_pending}")
        self.keys = Keys(namespace)
        self.name = name or default_node_id()
        self.max_pending = max_pending
        self.timeout = timeout
        self.limits = limits
        self.poll = poll
        self.redis = redis_client(redis_url)
        self._count_after = self.redis.register_script(_COUNT_AFTER)
        self._group_ready = False
        """The ``trainer`` group exists (created at id 0 by the first push if not)."""

    def encode(
        self, tensors: Mapping[str, torch.Tensor], policy_version: int, meta: Mapping[str, Any]
    ) -> dict[str, bytes]:
        """Stream fields; raises :class:`~weightcast.contract.codec.InvalidBatch` with the
        trainer's reason."""
        return encode_batch(
            tensors,
            {**meta, "policy_version": policy_version, "producer": self.name},
            self.limits,
        )

    def latest_version(self) -> int:
        """The newest published version (0 before the first): tag batches sampled from it."""
        return int(self.redis.get(self.keys.latest) or 0)

    def undelivered(self) -> int:
        """Entries the ``trainer`` group has not been handed yet (capped past the limit)."""
        self._ensure_group()
        found = _trainer_group(self.redis.xinfo_groups(self.keys.batches))
        if found is None:
            return self.redis.xlen(self.keys.batches)
        lag, last = found
        if lag is not None:
            return lag
        return int(self._count_after(keys=[self.keys.batches], args=[last, self.max_pending + 1]))

    def has_room(self) -> bool:
        """Whether a push would go through without waiting."""
        return not self.max_pending or self.undelivered() < self.max_pending

    def wait_for_room(self, stop: Stop | None = None) -> bool:
        """Block until fewer than ``max_pending`` entries are undelivered (True), ``stop`` is
        set (False), or time out with :class:`BackPressureTimeout`."""
        if not self.max_pending:
            return True
        deadline = time.monotonic() + self.timeout
        pause = self.poll
        stop = stop or threading.Event()
        while (undelivered := self.undelivered()) >= self.max_pending:
            if time.monotonic() >= deadline:
                raise self.timed_out(undelivered)
            if stop.wait(min(pause, max(0.0, deadline - time.monotonic()))):
                return False
            pause = min(pause * 2, _MAX_WAIT_STEP_S)
        return True

    def push(self, tensors: Mapping[str, torch.Tensor], policy_version: int, **meta: Any) -> str:
        """Validate, wait for room, add; the stream entry id."""
        entry = self.push_unless_stopped(tensors, policy_version, meta, None)
        assert entry is not None
        return entry

    def push_unless_stopped(
        self,
        tensors: Mapping[str, torch.Tensor],
        policy_version: int,
        meta: Mapping[str, Any],
        stop: Stop | None,
    ) -> str | None:
        """:meth:`push`, giving up (None, nothing added) if ``stop`` is set while it waits."""
        fields = self.encode(tensors, policy_version, meta)
        self._ensure_group()
        if not self.wait_for_room(stop):
            return None
        return self.redis.xadd(self.keys.batches, fields).decode()

    def timed_out(self, undelivered: int) -> BackPressureTimeout:
        return BackPressureTimeout(
            f"{undelivered} batches in {self.keys.batches} are still undelivered to the "
            f"'{TRAINER_GROUP}' group after {self.timeout:.0f}s (max_pending={self.max_pending}). "
            "Is a trainer running and reading this namespace? Start one, or raise max_pending "
            "or the timeout."
        )

    def close(self) -> None:
        self.redis.close()

    def _ensure_group(self) -> None:
        if not self._group_ready:
            ensure_group(self.redis, self.keys)
            self._group_ready = True


class AsyncBatchProducer:
    """:class:`BatchProducer` for asyncio code (it takes the same arguments): the same
    producer, each call in a worker thread, so validating, waiting for room and pushing
    never block the event loop. Cancelling a push that is waiting for room adds nothing."""

    def __init__(self, redis_url: str, namespace: str = "wc", **options: Any) -> None:
        self.producer = BatchProducer(redis_url, namespace, **options)

    @property
    def timeout(self) -> float:
        return self.producer.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.producer.timeout = seconds

    async def latest_version(self) -> int:
        return await asyncio.to_thread(self.producer.latest_version)

    async def undelivered(self) -> int:
        return await asyncio.to_thread(self.producer.undelivered)

    async def push(
        self, tensors: Mapping[str, torch.Tensor], policy_version: int, **meta: Any
    ) -> str:
        stop = threading.Event()
        try:
            entry = await asyncio.to_thread(
                self.producer.push_unless_stopped, tensors, policy_version, meta, stop
            )
        finally:
            stop.set()
        assert entry is not None  # only a cancelled push stops, and then nothing returns
        return entry

    async def close(self) -> None:
        await asyncio.to_thread(self.producer.close)
