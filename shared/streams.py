"""The batch stream: group creation and the two ways an entry leaves it (ack, dead letter)."""

from __future__ import annotations

from collections.abc import Mapping

import redis

from shared.keys import TRAINER_GROUP, Keys


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Create the ``trainer`` group at id 0, so batches pushed before any trainer count.

    Producers and trainers both call this; whichever comes first creates it.
    """
    try:
        client.xgroup_create(keys.batches, TRAINER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def dead_letter(
    client: redis.Redis, keys: Keys, entry_id: str, fields: Mapping[bytes | str, bytes], reason: str
) -> None:
    """Move an entry to the dead-letter stream with its reason, in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.xadd(keys.dead_letters, {**fields, "reason": reason, "orig_id": entry_id})
    pipe.xack(keys.batches, TRAINER_GROUP, entry_id)
    pipe.execute()
