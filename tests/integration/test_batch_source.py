"""The trainer's batch source against a real redis-server that restarts (AOF on), and what
the demo producer pushes."""

from __future__ import annotations

import threading
from pathlib import Path

import redis

from weightcast.contract.codec import BatchLimits
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.local.produce import run_produce
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.retry import Outage
from weightcast.runtime.settings import load_config
from weightcast_trainer.batch_source import BatchSource, SourceSettings, StreamBatch

from helpers.processes import wait_for
from helpers.redis_state import push_batches

LIMITS = BatchLimits(vocab_size=1024, max_seq_len=64)


def poll_until(source: BatchSource, count: int) -> list[StreamBatch]:
    got: list[StreamBatch] = []
    for _ in range(1000):
        if len(got) == count:
            return got
        if (item := source.poll()) is not None:
            got.append(item)
    raise AssertionError(f"only {len(got)} of {count} batches arrived")


def test_polling_rides_out_a_redis_restart_and_finds_entries_whose_reply_was_lost(
    tmp_path: Path, keys: Keys
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        client = redis.Redis.from_url(server.url)
        pushed = list(push_batches(server.url, keys, 4))
        outage = Outage(budget=60, first=0.1, cap=0.5)
        source = BatchSource(client, keys, "c", LIMITS, SourceSettings(block_ms=100), outage)
        source.recover(set())
        got = poll_until(source, 1)
        # Delivered to "c" without the source seeing it: a reply lost when Redis went away.
        client.xreadgroup(TRAINER_GROUP, "c", {keys.batches: ">"}, count=1)
        server.stop()
        restart = threading.Thread(  # once the source has met the outage
            target=lambda: (wait_for(lambda: outage.ongoing, 60, "the outage"), server.start())
        )
        restart.start()
        got += poll_until(source, 3)  # blocks, retrying, until Redis is back
        restart.join()

        assert sorted(item.entry_id for item in got) == sorted(pushed)  # each once
        assert not outage.ongoing
        source.ack([item.entry_id for item in got])
        assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
    finally:
        server.stop()


def test_the_demo_producers_malformed_batches_are_dead_lettered_with_the_reason(
    redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    """``weightcast produce --invalid-every 2`` (its code, in this process): the good batches
    arrive in order, each malformed one is dead-lettered with what is wrong with it."""
    settings = {
        "redis_url": redis_server.url,
        "namespace": keys.namespace,
        "produce.count": 4,
        "produce.invalid_every": 2,
        "produce.max_pending": 0,
    }
    assert run_produce(load_config(env={}, overrides=settings)) == 0
    source = BatchSource(client, keys, "c", LIMITS, SourceSettings(block_ms=100))
    source.recover(set())
    assert [item.batch.meta["index"] for item in poll_until(source, 4)] == [1, 2, 3, 4]
    assert source.poll() is None  # the last entry, malformed
    reasons = [fields[b"reason"].decode() for _, fields in client.xrange(keys.dead_letters)]
    assert len(reasons) == 2 and all("not a safetensors blob" in r for r in reasons), reasons
