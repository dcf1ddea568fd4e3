"""Rollout batches from the Redis stream, validated, with bad ones dead-lettered."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis

from shared.codec import BatchLimits, InvalidBatch, RolloutBatch, decode_batch
from shared.keys import TRAINER_GROUP, Keys
from shared.logs import get_logger
from shared.streams import dead_letter, ensure_group

log = get_logger("trainer.batches")


@dataclass
class StreamBatch:
    entry_id: str
    batch: RolloutBatch


class BatchSource:
    """Reads the ``trainer`` consumer group one entry at a time.

    Entries that break the batch contract go to the dead-letter stream with their reason and
    are acknowledged there; valid ones are returned and acknowledged by :meth:`ack` once
    trained.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        consumer: str,
        limits: BatchLimits,
        block_ms: int = 1000,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.limits = limits
        self.block_ms = block_ms
        self.dead_lettered = 0
        ensure_group(client, keys)

    def next(self, should_stop: Callable[[], bool]) -> StreamBatch | None:
        """The next valid batch, or None once ``should_stop()`` turns true while waiting."""
        while not should_stop():
            reply = self.client.xreadgroup(
                TRAINER_GROUP,
                self.consumer,
                {self.keys.batches: ">"},
                count=1,
                block=self.block_ms,
            )
            if not reply:
                continue
            entry_id, fields = reply[0][1][0]
            entry_id = entry_id.decode()
            try:
                return StreamBatch(entry_id, decode_batch(fields, self.limits))
            except InvalidBatch as exc:
                dead_letter(self.client, self.keys, entry_id, fields, exc.reason)
                self.dead_lettered += 1
                log.warning("dead-lettered batch", entry=entry_id, reason=exc.reason)
        return None

    def ack(self, entry_id: str) -> None:
        self.client.xack(self.keys.batches, TRAINER_GROUP, entry_id)
