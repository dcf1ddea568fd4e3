"""Rollout batches from the Redis stream for one consumer, with recovery and admission rules.

An entry leaves the group in one of four ways: trained and acknowledged once a durable
resume checkpoint holds it (:meth:`BatchSource.ack`), found already applied by such a
checkpoint (acknowledged without training), dead-lettered with a reason (contents that break
the contract or cannot be decoded at all, ``max_attempts`` failed attempts, or a step it made
non-finite), or dropped as stale (older than ``max_policy_lag`` versions behind the latest
published one; counted and acknowledged).

A failed attempt is a step that trained the entry and never finished (see
:mod:`weightcast.contract.streams`): deliveries, restarts and claims count nothing, so any
number of SIGKILLs between steps loses no good batch. Every Redis call rides out an outage
with capped exponential back-off (:class:`~weightcast.runtime.retry.Outage`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis

from weightcast.contract.codec import BatchLimits, InvalidBatch, RolloutBatch, decode_batch
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.streams import (
    abandoned_steps,
    acknowledge,
    begin_step,
    count_failed_step,
    dead_letter,
    end_step,
    ensure_group,
    failed_attempts,
)
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import Outage

log = get_logger("trainer.batches")

_PAGE = 100

T = TypeVar("T")
Fields = dict[bytes, bytes]


@dataclass
class StreamBatch:
    entry_id: str
    batch: RolloutBatch
    attempts: int = 0
    """Failed attempts so far; a batch with any is a suspect and trains alone."""


@dataclass(frozen=True)
class SourceSettings:
    block_ms: int = 1000
    max_attempts: int = 5
    """An entry with this many failed attempts is dead-lettered instead of trained again."""
    dead_letters_kept: int = 10_000
    """Newest dead-letter entries kept; 0 keeps all."""
    claim_idle_ms: int = 300_000
    """Entries of other consumers pending longer than this are claimed (a dead trainer's)."""
    max_policy_lag: int = 8
    """Drop batches older than ``latest - max_policy_lag`` versions; negative keeps all."""


class BatchSource:
    """Reads the ``trainer`` group as one consumer; one entry per :meth:`poll`."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        consumer: str,
        limits: BatchLimits,
        settings: SourceSettings,
        outage: Outage | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.limits = limits
        self.settings = settings
        self.outage = outage or Outage()
        self.backlog: deque[tuple[str, Fields, int]] = deque()
        self.held: set[str] = set()
        """Entries queued or handed out and not yet acknowledged: XAUTOCLAIM also returns
        this consumer's own idle entries, which must not be queued a second time."""
        self.applied: Container[str] = ()
        self.found_applied: dict[str, None] = {}
        """Re-delivered entries the weights already hold: ack them with the next checkpoint
        (they may have been applied after the last one, by a sibling rank)."""
        self.dead_lettered = 0
        self.stale_dropped = 0
        self.already_applied = 0
        self.claimed = 0
        self.latest = 0
        self._last_claim = 0.0
        self._version_steps: dict[int, int | None] = {}
        self._running = False
        self._replies_lost = False
        self._call(lambda: ensure_group(client, keys), "creating the trainer group")

    def recover(self, applied: Container[str]) -> None:
        """Count the step this consumer left unfinished, queue its pending entries, then
        claim idle ones of dead consumers.

        ``applied`` (kept, and updated by the trainer as it trains) holds the entries the
        weights already contain: those are never trained again but collected in
        :attr:`found_applied`, for the trainer to acknowledge once a checkpoint holds them
        (at start, the loaded one does: the crash came between checkpoint and XACK).
        """
        self.applied = applied
        self._count_failed_step(self.consumer)
        self._read_own_pending()
        log.info("recovered pending entries", consumer=self.consumer, queued=len(self.backlog))
        self.claim()

    def claim(self) -> None:
        """Take over what dead consumers left: count their unfinished steps, then XAUTOCLAIM
        entries idle longer than ``claim_idle_ms`` from any consumer."""
        self._last_claim = time.monotonic()
        idle_ms = self.settings.claim_idle_ms
        abandoned = self._call(
            lambda: abandoned_steps(self.client, self.keys, idle_ms), "finding abandoned steps"
        )
        for consumer in abandoned:
            if consumer != self.consumer:
                self._count_failed_step(consumer)
        start = "0-0"
        while True:
            start, entries, deleted = self._call(
                lambda start=start: self.client.xautoclaim(
                    self.keys.batches,
                    TRAINER_GROUP,
                    self.consumer,
                    min_idle_time=idle_ms,
                    start_id=start,
                    count=_PAGE,
                ),
                "claiming idle entries",
            )[:3]
            if entries:
                self.claimed += len(entries)
                log.info("claimed idle entries", count=len(entries), consumer=self.consumer)
                self._admit(entries)
            if deleted:
                log.warning("claimed entries that were deleted from the stream", ids=deleted)
            if start in (b"0-0", "0-0"):
                return

    def poll(self) -> StreamBatch | None:
        """The next admissible batch, or None after one empty wait of at most ``block_ms``."""
        if self._replies_lost:
            self._read_own_pending()
        if not self.backlog and (
            time.monotonic() - self._last_claim > self.settings.claim_idle_ms / 2000
        ):
            self.claim()
        if not self.backlog:
            reply = self._call(
                lambda: self.client.xreadgroup(
                    TRAINER_GROUP,
                    self.consumer,
                    {self.keys.batches: ">"},
                    count=1,
                    block=self.settings.block_ms,
                ),
                "waiting for batches",
            )
            if not reply:
                return None
            self._admit(reply[0][1], fresh=True)
        if not self.backlog:
            return None
        entry_id, fields, attempts = self.backlog.popleft()
        try:
            batch = decode_batch(fields, self.limits)
        except InvalidBatch as exc:
            self._dead_letter(entry_id, fields, exc.reason)
            return None
        lag = self.policy_lag(batch.policy_version)
        if 0 <= self.settings.max_policy_lag < lag:
            self.ack([entry_id])
            self.stale_dropped += 1
            log.warning(
                "dropped a stale batch",
                entry=entry_id,
                policy_version=batch.policy_version,
                latest=self.latest,
                max_policy_lag=self.settings.max_policy_lag,
            )
            return None
        return StreamBatch(entry_id, batch, attempts)

    def policy_lag(self, policy_version: int) -> int:
        """Latest published version (read now) minus ``policy_version``."""
        latest = self._call(lambda: self.client.get(self.keys.latest), "reading the latest version")
        self.latest = int(latest or 0)
        return self.latest - policy_version

    def version_step(self, policy_version: int) -> int | None:
        """The training step whose weights version ``policy_version`` holds (None for the
        uniform v0 or a version no longer registered); versions never change, so each is
        read once."""
        if policy_version not in self._version_steps:
            entry = self._call(
                lambda: self.client.hgetall(self.keys.version(policy_version)),
                "reading a version's step",
            )
            info = VersionInfo.from_fields(policy_version, entry) if entry else None
            self._version_steps[policy_version] = info.step if info else None
        return self._version_steps[policy_version]

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Acknowledge ``entry_ids`` and the re-delivered entries found already applied."""
        ids = [*entry_ids, *self.found_applied]
        self.found_applied = {}
        self.held.difference_update(ids)
        self._call(lambda: acknowledge(self.client, self.keys, ids), "acknowledging entries")

    def begin_step(self, entry_ids: Sequence[str]) -> None:
        """Record the entries of the step about to run: if it never finishes, each of them
        gets a failed attempt."""
        self._running = bool(entry_ids)
        if entry_ids:
            self._call(
                lambda: begin_step(self.client, self.keys, self.consumer, entry_ids),
                "recording the step",
            )

    def end_step(self) -> None:
        """The recorded step finished: applied, or skipped on purpose."""
        if self._running:
            self._call(lambda: end_step(self.client, self.keys, self.consumer), "ending the step")
            self._running = False

    def reject(self, entry_id: str, reason: str) -> None:
        """Dead-letter an entry this consumer holds (it made a step non-finite)."""
        rows = self._call(
            lambda: self.client.xrange(self.keys.batches, entry_id, entry_id), "reading an entry"
        )
        self._dead_letter(entry_id, rows[0][1] if rows else {}, reason)

    def _admit(self, entries: list[tuple[bytes, Fields]], fresh: bool = False) -> None:
        """Sort entries as Redis returns them: already applied, failed too often, or to train.

        ``fresh`` entries were never delivered before, so they have no failed attempts.
        """
        decoded = [(raw_id.decode(), fields) for raw_id, fields in entries]
        ids = [entry_id for entry_id, _ in decoded]
        attempts = (
            {}
            if fresh
            else self._call(
                lambda: failed_attempts(self.client, self.keys, ids), "reading failed attempts"
            )
        )
        limit = self.settings.max_attempts
        for entry_id, fields in decoded:
            failed = attempts.get(entry_id, 0)
            if entry_id in self.held or entry_id in self.found_applied:
                continue
            if not fields:  # deleted from the stream (XTRIM/XDEL) while pending
                self._call(
                    lambda entry_id=entry_id: acknowledge(self.client, self.keys, [entry_id]),
                    "acknowledging a deleted entry",
                )
            elif entry_id in self.applied:
                self.found_applied[entry_id] = None
                self.already_applied += 1
                log.info("re-delivered entry is already applied; not training it", entry=entry_id)
            elif failed >= limit:
                self._dead_letter(
                    entry_id,
                    fields,
                    f"failed {failed} attempts (trainer.max_attempts={limit}): the trainer died "
                    "or raised in every step that trained this batch",
                )
            else:
                self.backlog.append((entry_id, fields, failed))
                self.held.add(entry_id)

    def _read_own_pending(self) -> None:
        """Queue the entries delivered to this consumer and not acknowledged, oldest first.

        Run at start, and after a Redis call had to be retried: its reply may have carried
        entries that the group now counts as delivered to this consumer.
        """
        self._replies_lost = False
        start = "0"
        while True:
            reply = self._call(
                lambda start=start: self.client.xreadgroup(
                    TRAINER_GROUP, self.consumer, {self.keys.batches: start}, count=_PAGE
                ),
                "reading this consumer's pending entries",
            )
            entries = reply[0][1] if reply else []
            if not entries:
                return
            self._admit(entries)
            start = entries[-1][0].decode()

    def _count_failed_step(self, consumer: str) -> None:
        counted = self._call(
            lambda: count_failed_step(self.client, self.keys, consumer),
            "counting an unfinished step",
        )
        if counted:
            log.warning(
                "a step never finished (the trainer died or raised in it); "
                "counted a failed attempt for each of its batches",
                consumer=consumer,
                entries=",".join(counted),
            )

    def _dead_letter(self, entry_id: str, fields: Fields, reason: str) -> None:
        keep = self.settings.dead_letters_kept
        self._call(
            lambda: dead_letter(self.client, self.keys, entry_id, fields, reason, keep),
            "dead-lettering an entry",
        )
        self.held.discard(entry_id)
        self.dead_lettered += 1
        log.warning("dead-lettered batch", entry=entry_id, reason=reason)

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` through a Redis outage. A retried call may have taken effect without its
        reply arriving (entries delivered to this consumer): the next poll re-reads them."""
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            return fn()

        result = self.outage.call(attempt, what)
        if tries > 1:
            self._replies_lost = True
        return result
