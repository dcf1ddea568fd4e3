"""Rollout batches from the Redis stream for one consumer, with recovery and admission rules.

An entry leaves the group in one of four ways: trained and acknowledged once a durable
resume checkpoint holds it (:meth:`BatchSource.ack`), found already applied by such a
checkpoint (acknowledged without training), dead-lettered with a reason (bad contents, or
delivered more than ``max_deliveries`` times), or dropped as stale (older than
``max_policy_lag`` versions behind the latest published one; counted and acknowledged).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container, Sequence
from dataclasses import dataclass

import redis

from weightcast.contract.codec import BatchLimits, InvalidBatch, RolloutBatch, decode_batch
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.streams import dead_letter, ensure_group
from weightcast.runtime.logs import get_logger

log = get_logger("trainer.batches")

_PAGE = 100

Fields = dict[bytes, bytes]


@dataclass
class StreamBatch:
    entry_id: str
    batch: RolloutBatch


@dataclass(frozen=True)
class SourceSettings:
    block_ms: int = 1000
    max_deliveries: int = 5
    """An entry delivered more often than this (crashes, claims) is dead-lettered."""
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
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.limits = limits
        self.settings = settings
        self.backlog: deque[tuple[str, Fields]] = deque()
        self.held: set[str] = set()
        """Entries queued or handed out and not yet acknowledged: XAUTOCLAIM also returns
        this consumer's own idle entries, which must not be queued a second time."""
        self.applied: Container[str] = ()
        self.found_applied: list[str] = []
        """Re-delivered entries the weights already hold: ack them with the next checkpoint
        (they may have been applied after the last one, by a sibling rank)."""
        self.dead_lettered = 0
        self.stale_dropped = 0
        self.already_applied = 0
        self.claimed = 0
        self.latest = 0
        self._last_claim = 0.0
        ensure_group(client, keys)

    def recover(self, applied: Container[str]) -> None:
        """Queue this consumer's pending entries, then claim idle ones of dead consumers.

        ``applied`` (kept, and updated by the trainer as it trains) holds the entries the
        weights already contain: those are never trained again but collected in
        :attr:`found_applied`, for the trainer to acknowledge once a checkpoint holds them
        (at start, the loaded one does: the crash came between checkpoint and XACK).
        """
        self.applied = applied
        start = "0"
        while True:
            reply = self.client.xreadgroup(
                TRAINER_GROUP, self.consumer, {self.keys.batches: start}, count=_PAGE
            )
            entries = reply[0][1] if reply else []
            if not entries:
                break
            self._admit(entries)
            start = entries[-1][0].decode()
        log.info("recovered pending entries", consumer=self.consumer, queued=len(self.backlog))
        self.claim()

    def claim(self) -> None:
        """XAUTOCLAIM entries idle longer than ``claim_idle_ms`` from any other consumer."""
        self._last_claim = time.monotonic()
        start = "0-0"
        while True:
            start, entries, deleted = self.client.xautoclaim(
                self.keys.batches,
                TRAINER_GROUP,
                self.consumer,
                min_idle_time=self.settings.claim_idle_ms,
                start_id=start,
                count=_PAGE,
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
        if not self.backlog and (
            time.monotonic() - self._last_claim > self.settings.claim_idle_ms / 2000
        ):
            self.claim()
        if not self.backlog:
            reply = self.client.xreadgroup(
                TRAINER_GROUP,
                self.consumer,
                {self.keys.batches: ">"},
                count=1,
                block=self.settings.block_ms,
            )
            if not reply:
                return None
            self._admit(reply[0][1], fresh=True)
        if not self.backlog:
            return None
        entry_id, fields = self.backlog.popleft()
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
        return StreamBatch(entry_id, batch)

    def policy_lag(self, policy_version: int) -> int:
        """Latest published version (read now) minus ``policy_version``."""
        self.latest = int(self.client.get(self.keys.latest) or 0)
        return self.latest - policy_version

    def ack(self, entry_ids: Sequence[str]) -> None:
        """Acknowledge ``entry_ids`` and the re-delivered entries found already applied."""
        ids = [*entry_ids, *self.found_applied]
        self.found_applied = []
        self.held.difference_update(ids)
        if ids:
            self.client.xack(self.keys.batches, TRAINER_GROUP, *ids)

    def _admit(self, entries: list[tuple[bytes, Fields]], fresh: bool = False) -> None:
        """Sort entries as Redis returns them: already applied, delivered too often, or to train.

        ``fresh`` entries were never delivered before, so they need no delivery count.
        """
        decoded = [(raw_id.decode(), fields) for raw_id, fields in entries]
        deliveries = {} if fresh else self._deliveries([entry_id for entry_id, _ in decoded])
        for entry_id, fields in decoded:
            if entry_id in self.held:
                continue
            if not fields:  # deleted from the stream (XTRIM/XDEL) while pending
                self.client.xack(self.keys.batches, TRAINER_GROUP, entry_id)
            elif entry_id in self.applied:
                self.found_applied.append(entry_id)
                self.already_applied += 1
                log.info("re-delivered entry is already applied; not training it", entry=entry_id)
            elif deliveries.get(entry_id, 1) > self.settings.max_deliveries:
                self._dead_letter(
                    entry_id,
                    fields,
                    f"delivered {deliveries[entry_id]} times, more than trainer.max_deliveries="
                    f"{self.settings.max_deliveries} (the trainer may have crashed on it)",
                )
            else:
                self.backlog.append((entry_id, fields))
                self.held.add(entry_id)

    def _deliveries(self, entry_ids: list[str]) -> dict[str, int]:
        pipe = self.client.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(
                self.keys.batches, TRAINER_GROUP, min=entry_id, max=entry_id, count=1
            )
        return {
            rows[0]["message_id"].decode(): rows[0]["times_delivered"]
            for rows in pipe.execute()
            if rows
        }

    def _dead_letter(self, entry_id: str, fields: Fields, reason: str) -> None:
        dead_letter(
            self.client, self.keys, entry_id, fields, reason, self.settings.dead_letters_kept
        )
        self.held.discard(entry_id)
        self.dead_lettered += 1
        log.warning("dead-lettered batch", entry=entry_id, reason=reason)
