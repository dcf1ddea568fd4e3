"""The producer client against a real redis-server and the trainer's own batch source."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import redis
import torch
from safetensors.torch import save as save_safetensors

from weightcast.client.producer import AsyncBatchProducer, BackPressureTimeout, BatchProducer
from weightcast.contract.codec import BATCH_FIELD, META_FIELD, BatchLimits, InvalidBatch
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.local.produce import synthetic_batch
from weightcast.local.redis_server import RedisServer
from weightcast_trainer.batch_source import BatchSource, SourceSettings

from helpers.processes import wait_for

LIMITS = BatchLimits(vocab_size=1024, max_seq_len=16)


def good_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two sequences of 8 tokens, the second half trained."""
    generator = torch.Generator().manual_seed(seed)
    return synthetic_batch(generator, batch_size=2, seq_len=8, vocab_size=1024)


def trainer_source(client: redis.Redis, keys: Keys) -> BatchSource:
    return BatchSource(client, keys, "trainer-0", LIMITS, SourceSettings(block_ms=100))


def count_looks(producer: BatchProducer) -> Callable[[], int]:
    """How often ``producer`` has counted the undelivered batches since: a push that waits
    for room counts them again and again."""
    looks = 0
    count = producer.undelivered

    def counted() -> int:
        nonlocal looks
        looks += 1
        return count()

    producer.undelivered = counted  # type: ignore[method-assign]
    return lambda: looks


def consume_one(source: BatchSource) -> str:
    """Read like the trainer until one batch arrives, then acknowledge it."""
    while (item := source.poll()) is None:
        pass
    source.ack([item.entry_id])
    return item.entry_id


def test_push_blocks_at_the_limit_and_resumes_when_the_trainer_consumes(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    producer = BatchProducer(redis_server.url, keys.namespace, max_pending=3, timeout=60)
    for seed in range(3):
        producer.push(good_batch(seed), policy_version=0)
    assert producer.undelivered() == 3
    pushed = threading.Event()
    blocked = threading.Thread(
        target=lambda: (producer.push(good_batch(9), policy_version=0), pushed.set())
    )
    looks = count_looks(producer)
    blocked.start()
    wait_for(lambda: looks() >= 3, 30, "the push to look for room three times")
    assert not pushed.is_set(), "push went through with 3 batches undelivered"
    assert client.xlen(keys.batches) == 3
    consume_one(trainer_source(client, keys))  # the trainer takes one: room for one more
    assert pushed.wait(30), "push stayed blocked after the trainer consumed a batch"
    blocked.join()
    assert client.xlen(keys.batches) == 4  # nothing trimmed, acknowledged or not
    assert producer.undelivered() == 3


def test_push_times_out_with_a_clear_error_when_no_trainer_reads(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    producer = BatchProducer(redis_server.url, keys.namespace, max_pending=1, timeout=0.5)
    producer.push(good_batch(), policy_version=0)
    with pytest.raises(BackPressureTimeout, match=r"1 batches .* undelivered .* trainer running"):
        producer.push(good_batch(1), policy_version=0)
    assert client.xlen(keys.batches) == 1  # the refused batch was not added


def test_undelivered_is_counted_even_when_redis_cannot_report_the_lag(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    producer = BatchProducer(redis_server.url, keys.namespace, max_pending=10)
    ids = [producer.push(good_batch(s), policy_version=0) for s in range(5)]
    consume_one(trainer_source(client, keys))
    client.xdel(keys.batches, ids[2])  # a deleted entry makes the group's lag unknown
    (group,) = client.xinfo_groups(keys.batches)
    assert group["name"].decode() == TRAINER_GROUP and group["lag"] is None
    assert producer.undelivered() == 3  # ids[1], ids[3], ids[4]


def test_a_bad_batch_fails_at_the_producer_with_the_trainers_reason(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    producer = BatchProducer(redis_server.url, keys.namespace, name="p", limits=LIMITS)
    source = trainer_source(client, keys)
    bad = {
        "float ids": {**good_batch(), "input_ids": torch.rand(2, 8)},
        "id over vocab": {**good_batch(), "input_ids": torch.full((2, 8), 1024)},
        "too long": {
            **good_batch(),
            "input_ids": torch.zeros(2, 32, dtype=torch.long),
            "loss_mask": torch.ones(2, 32),
        },
        "empty mask": {**good_batch(), "loss_mask": torch.zeros(2, 8)},
        "nan advantage": {**good_batch(), "advantages": torch.tensor([0.0, float("nan")])},
        "misspelt tensor": {**good_batch(), "advantage": torch.zeros(2)},
        "short logprobs": {**good_batch(), "old_logprobs": torch.zeros(2, 7)},
    }
    for case, tensors in bad.items():
        with pytest.raises(InvalidBatch) as at_producer:
            producer.push(tensors, policy_version=3)
        meta = b'{"policy_version": 3, "producer": "p"}'
        client.xadd(keys.batches, {BATCH_FIELD: save_safetensors(tensors), META_FIELD: meta})
        assert source.poll() is None
        (dead,) = client.xrange(keys.dead_letters, count=1, min="-")[-1:]
        client.delete(keys.dead_letters)
        assert dead[1][b"reason"].decode() == at_producer.value.reason, case
    with pytest.raises(InvalidBatch) as at_producer:
        producer.push(good_batch(), policy_version=-1)
    assert "policy_version must be an int >= 0" in at_producer.value.reason


def test_async_producer_waits_without_blocking_the_event_loop(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    source = trainer_source(client, keys)

    async def scenario() -> list[str]:
        producer = AsyncBatchProducer(redis_server.url, keys.namespace, max_pending=2, timeout=60)
        first = [await producer.push(good_batch(s), policy_version=0) for s in range(2)]
        looks = count_looks(producer.producer)
        third = asyncio.create_task(producer.push(good_batch(5), policy_version=0))
        await asyncio.to_thread(wait_for, lambda: looks() >= 3, 30, "three looks for room")
        assert not third.done(), "push went through with 2 batches undelivered"
        consumed = await asyncio.to_thread(consume_one, source)  # the loop keeps running
        pushed = await asyncio.wait_for(third, 30)
        with pytest.raises(BackPressureTimeout):
            producer.timeout = 0.3
            await producer.push(good_batch(6), policy_version=0)
        await producer.close()
        return [*first, consumed, pushed]

    first, second, consumed, pushed = asyncio.run(scenario())
    assert consumed == first and pushed > second
    assert client.xlen(keys.batches) == 3


def test_a_cancelled_async_push_adds_nothing(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        producer = AsyncBatchProducer(
            redis_server.url, keys.namespace, max_pending=1, timeout=60, poll=0.01
        )
        await producer.push(good_batch(0), policy_version=0)
        returned: list[str | None] = []
        push = producer.producer.push_unless_stopped

        def recorded(*args: object) -> str | None:
            returned.append(entry := push(*args))
            return entry

        producer.producer.push_unless_stopped = recorded  # type: ignore[method-assign]
        looks = count_looks(producer.producer)
        waiting = asyncio.create_task(producer.push(good_batch(1), policy_version=0))
        await asyncio.to_thread(wait_for, lambda: looks() >= 2, 30, "the push to wait")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.to_thread(wait_for, lambda: returned, 30, "the push's thread to stop")
        assert returned == [None]  # it gave up without adding, and can add nothing later
        consume_one(trainer_source(client, keys))
        await producer.close()

    asyncio.run(scenario())
    assert client.xlen(keys.batches) == 1
