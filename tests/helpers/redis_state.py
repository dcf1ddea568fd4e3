"""Batches pushed into a real Redis, and what the trainer left there (heartbeat, pending,
dead letters)."""

from __future__ import annotations

import json
from typing import Any

import redis
import torch
from safetensors.torch import save

from weightcast.client.producer import BatchProducer
from weightcast.contract.codec import BATCH_FIELD, META_FIELD
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.local.produce import synthetic_batch


def push_batches(
    redis_url: str,
    keys: Keys,
    count: int,
    policy_version: int = 0,
    prefix: str = "b",
    seed: int = 0,
    vocab_size: int = 1024,
    skip: int = 0,
) -> dict[str, str]:
    """Push ``count`` valid batches, each with a unique ``meta.uid``; stream id -> uid.

    The batches are those after the first ``skip`` of the ``seed``'s sequence, so two calls
    can push one sequence in two parts."""
    producer = BatchProducer(redis_url, keys.namespace, name="test-producer", max_pending=0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(skip):
        synthetic_batch(generator, batch_size=2, seq_len=16, vocab_size=vocab_size)
    pushed = {}
    for index in range(skip, skip + count):
        uid = f"{prefix}{index}"
        tensors = synthetic_batch(generator, batch_size=2, seq_len=16, vocab_size=vocab_size)
        pushed[producer.push(tensors, policy_version, uid=uid)] = uid
    return pushed


def push_raw(client: redis.Redis, keys: Keys, tensors: dict[str, torch.Tensor], **meta: Any) -> str:
    """Add an entry as a careless producer would, without validating it first."""
    fields = {
        BATCH_FIELD: save(tensors),
        META_FIELD: json.dumps({"policy_version": 0, "producer": "careless", **meta}),
    }
    return client.xadd(keys.batches, fields).decode()


def heartbeat(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer_heartbeat).items()}


def pending(client: redis.Redis, keys: Keys) -> int:
    return client.xpending(keys.batches, TRAINER_GROUP)["pending"]


def dead_letters(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """Dead-lettered entries: original stream id -> reason, oldest first."""
    return {
        fields[b"orig_id"].decode(): fields[b"reason"].decode()
        for _, fields in client.xrange(keys.dead_letters)
    }


def redis_ms(client: redis.Redis) -> int:
    """Redis's clock in milliseconds: what lease expiries are scored against."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def subscribers(client: redis.Redis, channel: str) -> int:
    """How many connections are subscribed to ``channel`` now."""
    return dict(client.pubsub_numsub(channel))[channel.encode()]
