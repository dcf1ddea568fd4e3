"""The batch stream: group creation, the two ways an entry leaves a group (ack, dead letter),
and trimming what every group has acknowledged."""

from __future__ import annotations

from collections.abc import Mapping

import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys


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
    client: redis.Redis,
    keys: Keys,
    entry_id: str,
    fields: Mapping[bytes | str, bytes],
    reason: str,
    keep: int = 0,
) -> None:
    """Move an entry to the dead-letter stream with its reason, in one transaction.

    With ``keep`` > 0 the dead-letter stream keeps only its newest ``keep`` entries, so a
    producer that keeps sending bad batches cannot fill Redis with them; 0 keeps them all.
    """
    pipe = client.pipeline(transaction=True)
    pipe.xadd(
        keys.dead_letters,
        {**fields, "reason": reason, "orig_id": entry_id},
        maxlen=keep or None,
        approximate=False,
    )
    pipe.xack(keys.batches, TRAINER_GROUP, entry_id)
    pipe.execute()


def trim_acknowledged(client: redis.Redis, keys: Keys) -> int:
    """Delete the entries every consumer group of the batch stream has acknowledged.

    An entry is gone from every group once each group has delivered it and none still holds
    it pending: it lies at or below each group's last-delivered id and below its oldest
    pending one.
    Both bounds only grow while this runs, so entries delivered or claimed meanwhile are
    never cut. Returns the number of entries deleted; without groups nothing is deleted.
    """
    try:
        groups = client.xinfo_groups(keys.batches)
    except redis.ResponseError:  # no stream yet
        return 0
    if not groups:
        return 0
    bounds = []
    for group in groups:
        ms, seq = parse_stream_id(group["last-delivered-id"])
        bounds.append((ms, seq + 1))  # the last delivered entry itself, once acknowledged
        # None when nothing is pending, also when XINFO counted some that another trainer
        # rank has acknowledged since.
        oldest = client.xpending(keys.batches, group["name"])["min"]
        if oldest is not None:
            bounds.append(parse_stream_id(oldest))
    ms, seq = min(bounds)
    return client.xtrim(keys.batches, minid=f"{ms}-{seq}", approximate=False)


def parse_stream_id(raw: bytes | str) -> tuple[int, int]:
    """A stream id ``"<ms>-<seq>"`` (as Redis or redis-py gives it) as ``(ms, seq)``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
