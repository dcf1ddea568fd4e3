"""The batch stream: group creation, the two ways an entry leaves a group (ack, dead letter),
the failed attempts of entries, and trimming what every group has acknowledged.

Failed attempts are counted per entry, not per delivery: before a trainer consumer runs a
step it records the step's entry ids under its name in ``{wc}:trainer:running``
(:func:`begin_step`) and removes them when the step has finished (:func:`end_step`). A record
left behind means the process died or raised inside that step; whoever finds it (the same
consumer restarting, or a trainer claiming a dead consumer's entries) counts one failed
attempt for each of its entries in ``{wc}:trainer:attempts`` (:func:`count_failed_step`).
Restarts, claims and re-deliveries count nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis

from weightcast.contract.errors import RedisGroupExists
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.redis_replies import refusal

_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
    return 0
end
local fields = {}
for i = 4, #ARGV do
    fields[#fields + 1] = ARGV[i]
end
if ARGV[3] == '0' then
    redis.call('XADD', KEYS[2], '*', unpack(fields))
else
    redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[3], '*', unpack(fields))
end
redis.call('HDEL', KEYS[3], ARGV[2])
return 1
"""
"""Dead-letter one entry if this group still holds it pending: retrying it after a lost reply
adds no second copy."""

_COUNT_FAILED_STEP = """
local ids = redis.call('HGET', KEYS[1], ARGV[1])
if not ids then
    return {}
end
local counted = {}
for id in string.gmatch(ids, '[^,]+') do
    redis.call('HINCRBY', KEYS[2], id, 1)
    counted[#counted + 1] = id
end
redis.call('HDEL', KEYS[1], ARGV[1])
return counted
"""
"""Turn a consumer's record of an unfinished step into one failed attempt per entry, once."""


def ensure_group(client: redis.Redis, keys: Keys) -> None:
    """Create the ``trainer`` group at id 0, so batches pushed before any trainer count.

    Producers and trainers both call this; whichever comes first creates it.
    """
    try:
        client.xgroup_create(keys.batches, TRAINER_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if refusal(exc) is not RedisGroupExists:
            raise


def dead_letter(
    client: redis.Redis,
    keys: Keys,
    entry_id: str,
    fields: Mapping[bytes | str, bytes],
    reason: str,
    keep: int = 0,
) -> bool:
    """Move a pending entry to the dead-letter stream with its reason, atomically.

    The entry gets the fields ``reason`` and ``orig_id`` beside its own, and its failed
    attempts are forgotten. Nothing happens when the group no longer holds the entry pending
    (already acknowledged or dead-lettered), so a retry after a lost reply is harmless; returns
    whether it was moved. With ``keep`` > 0 the dead-letter stream keeps only its newest
    ``keep`` entries, so a producer that keeps sending bad batches cannot fill Redis with them;
    0 keeps them all.
    """
    flat: list[bytes | str] = []
    for name, value in {**fields, "reason": reason, "orig_id": entry_id}.items():
        flat += [name, value]
    moved = client.eval(
        _DEAD_LETTER,
        3,
        keys.batches,
        keys.dead_letters,
        keys.trainer_attempts,
        TRAINER_GROUP,
        entry_id,
        str(keep),
        *flat,
    )
    return bool(moved)


def acknowledge(client: redis.Redis, keys: Keys, entry_ids: Sequence[str]) -> None:
    """XACK ``entry_ids`` in the trainer group and forget their failed attempts."""
    if not entry_ids:
        return
    pipe = client.pipeline(transaction=True)
    pipe.xack(keys.batches, TRAINER_GROUP, *entry_ids)
    pipe.hdel(keys.trainer_attempts, *entry_ids)
    pipe.execute()


def begin_step(client: redis.Redis, keys: Keys, consumer: str, entry_ids: Sequence[str]) -> None:
    """Record that ``consumer`` is about to train ``entry_ids`` in one step."""
    if entry_ids:
        client.hset(keys.trainer_running, consumer, ",".join(entry_ids))


def end_step(client: redis.Redis, keys: Keys, consumer: str) -> None:
    """The step ``consumer`` recorded has finished (applied, or skipped on purpose)."""
    client.hdel(keys.trainer_running, consumer)


def count_failed_step(client: redis.Redis, keys: Keys, consumer: str) -> list[str]:
    """If ``consumer`` left a step unfinished, count a failed attempt for each of its
    entries and drop the record; the entries counted (none if there was no record)."""
    counted = client.eval(
        _COUNT_FAILED_STEP, 2, keys.trainer_running, keys.trainer_attempts, consumer
    )
    return [entry_id.decode() for entry_id in counted]


def abandoned_steps(client: redis.Redis, keys: Keys, idle_ms: int) -> list[str]:
    """Consumers with an unfinished step that have not touched the stream for ``idle_ms``
    (or no longer exist in the group): their step died with them."""
    running = [name.decode() for name in client.hkeys(keys.trainer_running)]
    if not running:
        return []
    idle = {
        row["name"].decode(): row["idle"]
        for row in client.xinfo_consumers(keys.batches, TRAINER_GROUP)
    }
    return [name for name in running if idle.get(name, idle_ms) >= idle_ms]


def failed_attempts(client: redis.Redis, keys: Keys, entry_ids: Sequence[str]) -> dict[str, int]:
    """Failed attempts of each of ``entry_ids`` (0 when none were counted)."""
    if not entry_ids:
        return {}
    counts = client.hmget(keys.trainer_attempts, list(entry_ids))
    return {entry_id: int(n or 0) for entry_id, n in zip(entry_ids, counts, strict=True)}


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
