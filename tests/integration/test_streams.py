"""Trimming the batch stream: only what every consumer group has acknowledged goes."""

from __future__ import annotations

import threading

import redis

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
    trim_acknowledged,
)


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
    late = client.xadd(keys.batches, {"n": "4"})
    client.xreadgroup(TRAINER_GROUP, "a", {keys.batches: ">"})
    dead_letter(client, keys, late.decode(), {}, "kept forever", keep=0)
    assert client.xlen(keys.dead_letters) == 3


def test_trimming_while_two_consumers_read_and_acknowledge(client: redis.Redis, keys: Keys) -> None:
    """The race of a multi-rank trainer: one rank trims while others read and acknowledge.

    Every entry must still be in the stream while a consumer holds it pending, and the
    trimmer must not fail when the pending entries it counted are acknowledged under it.
    """
    ensure_group(client, keys)
    pipe = client.pipeline(transaction=False)
    for i in range(600):
        pipe.xadd(keys.batches, {"n": str(i)})
    pushed = pipe.execute()
    trimmed_while_pending: list[bytes] = []
    consumed: list[bytes] = []
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        own = redis.Redis(connection_pool=client.connection_pool)
        while reply := own.xreadgroup(TRAINER_GROUP, name, {keys.batches: ">"}, count=3):
            entry_ids = [entry_id for entry_id, _ in reply[0][1]]
            for entry_id in entry_ids:
                if not own.xrange(keys.batches, entry_id, entry_id):
                    trimmed_while_pending.append(entry_id)
            own.xack(keys.batches, TRAINER_GROUP, *entry_ids)
            consumed.extend(entry_ids)

    def trim(stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                trim_acknowledged(client, keys)
        except BaseException as exc:
            errors.append(exc)

    stop = threading.Event()
    trimmer = threading.Thread(target=trim, args=(stop,))
    trimmer.start()
    consumers = [threading.Thread(target=consume, args=(f"rank{r}",)) for r in range(2)]
    for thread in consumers:
        thread.start()
    for thread in consumers:
        thread.join()
    stop.set()
    trimmer.join()

    assert errors == [] and trimmed_while_pending == []
    assert sorted(consumed) == sorted(pushed)
    trim_acknowledged(client, keys)
    assert client.xlen(keys.batches) == 0


def test_a_step_left_unfinished_counts_one_failed_attempt_per_entry_once(
    client: redis.Redis, keys: Keys
) -> None:
    begin_step(client, keys, "a", ["1-0", "2-0"])
    end_step(client, keys, "a")  # finished: nothing to count
    assert count_failed_step(client, keys, "a") == []
    begin_step(client, keys, "a", ["1-0", "2-0"])  # ... and the process dies here
    begin_step(client, keys, "b", ["3-0"])
    assert count_failed_step(client, keys, "a") == ["1-0", "2-0"]
    assert count_failed_step(client, keys, "a") == []  # counted once, by whoever finds it
    begin_step(client, keys, "a", ["2-0"])
    count_failed_step(client, keys, "a")
    assert failed_attempts(client, keys, ["1-0", "2-0", "3-0"]) == {"1-0": 1, "2-0": 2, "3-0": 0}
    assert client.hkeys(keys.trainer_running) == [b"b"]


def test_steps_of_consumers_idle_past_the_claim_time_are_abandoned(
    client: redis.Redis, keys: Keys
) -> None:
    ensure_group(client, keys)
    client.xadd(keys.batches, {"n": "0"})
    client.xreadgroup(TRAINER_GROUP, "live", {keys.batches: ">"})
    begin_step(client, keys, "live", ["1-0"])
    begin_step(client, keys, "gone", ["2-0"])  # no longer a consumer of the group
    assert abandoned_steps(client, keys, idle_ms=60_000) == ["gone"]
    assert sorted(abandoned_steps(client, keys, idle_ms=0)) == ["gone", "live"]


def test_acknowledging_or_dead_lettering_forgets_failed_attempts_and_repeats_safely(
    client: redis.Redis, keys: Keys
) -> None:
    ensure_group(client, keys)
    first, second = (client.xadd(keys.batches, {"n": str(i)}).decode() for i in range(2))
    client.xreadgroup(TRAINER_GROUP, "a", {keys.batches: ">"})
    client.hset(keys.trainer_attempts, mapping={first: 2, second: 1})
    assert dead_letter(client, keys, first, {b"n": b"0"}, "poison")
    assert not dead_letter(client, keys, first, {b"n": b"0"}, "poison")  # a retry adds nothing
    assert client.xlen(keys.dead_letters) == 1
    acknowledge(client, keys, [second])
    assert client.hlen(keys.trainer_attempts) == 0
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
