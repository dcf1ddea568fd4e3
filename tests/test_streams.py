"""Trimming the batch stream: only what every consumer group has acknowledged goes."""

from __future__ import annotations

import redis

from shared.keys import TRAINER_GROUP, Keys
from shared.streams import dead_letter, ensure_group, trim_acknowledged


def ids(client: redis.Redis, keys: Keys) -> list[bytes]:
    return [entry_id for entry_id, _ in client.xrange(keys.batches)]


def test_trim_keeps_pending_and_undelivered_entries(client: redis.Redis, keys: Keys) -> None:
    assert trim_acknowledged(client, keys) == 0  # no stream yet
    ensure_group(client, keys)
    pushed = [client.xadd(keys.batches, {"n": str(i)}) for i in range(6)]
    client.xreadgroup(TRAINER_GROUP, "a", {keys.batches: ">"}, count=4)
    client.xack(keys.batches, TRAINER_GROUP, pushed[0], pushed[1], pushed[3])

    assert trim_acknowledged(client, keys) == 2  # below the oldest pending entry, pushed[2]
    assert ids(client, keys) == pushed[2:]

    client.xack(keys.batches, TRAINER_GROUP, pushed[2])
    assert trim_acknowledged(client, keys) == 2  # pushed[2] and pushed[3], the last delivered
    assert ids(client, keys) == pushed[4:]  # never delivered: kept
    assert trim_acknowledged(client, keys) == 0


def test_a_group_that_has_not_read_an_entry_keeps_it(client: redis.Redis, keys: Keys) -> None:
    ensure_group(client, keys)
    pushed = [client.xadd(keys.batches, {"n": str(i)}) for i in range(3)]
    client.xgroup_create(keys.batches, "audit", id="0")
    client.xreadgroup(TRAINER_GROUP, "a", {keys.batches: ">"})
    client.xack(keys.batches, TRAINER_GROUP, *pushed)
    assert trim_acknowledged(client, keys) == 0  # "audit" has delivered nothing yet

    client.xreadgroup("audit", "b", {keys.batches: ">"}, count=2)
    client.xack(keys.batches, "audit", *pushed[:2])
    assert trim_acknowledged(client, keys) == 2
    assert ids(client, keys) == pushed[2:]


def test_dead_letters_keep_their_reason_and_only_the_newest_are_kept(
    client: redis.Redis, keys: Keys
) -> None:
    ensure_group(client, keys)
    pushed = [client.xadd(keys.batches, {"n": str(i)}) for i in range(4)]
    client.xreadgroup(TRAINER_GROUP, "a", {keys.batches: ">"})
    for i, entry_id in enumerate(pushed):
        dead_letter(client, keys, entry_id.decode(), {"n": str(i).encode()}, f"bad {i}", keep=2)

    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0  # all acknowledged
    kept = [fields for _, fields in client.xrange(keys.dead_letters)]
    assert [(f[b"n"], f[b"reason"], f[b"orig_id"]) for f in kept] == [
        (b"2", b"bad 2", pushed[2]),
        (b"3", b"bad 3", pushed[3]),
    ]
    dead_letter(client, keys, pushed[0].decode(), {}, "kept forever", keep=0)
    assert client.xlen(keys.dead_letters) == 3
