"""The rollout-producer side: push batches, validated with the trainer's own rules."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import redis
import torch

from shared.codec import BATCH_FIELD, META_FIELD, encode_batch
from shared.config import Config
from shared.keys import Keys
from shared.logs import get_logger
from shared.streams import ensure_group

log = get_logger("produce")


class BatchProducer:
    """Pushes micro-batches onto ``{wc}:batches``; a bad batch raises ``InvalidBatch`` here."""

    def __init__(self, client: redis.Redis, keys: Keys, name: str) -> None:
        self.redis = client
        self.keys = keys
        self.name = name
        ensure_group(client, keys)

    def latest_version(self) -> int:
        return int(self.redis.get(self.keys.latest) or 0)

    def push(self, tensors: Mapping[str, torch.Tensor], policy_version: int, **meta: Any) -> str:
        fields = encode_batch(
            tensors, {"policy_version": policy_version, "producer": self.name, **meta}
        )
        return self.redis.xadd(self.keys.batches, fields).decode()


def synthetic_batch(
    generator: torch.Generator, batch_size: int, seq_len: int, vocab_size: int
) -> dict[str, torch.Tensor]:
    """A valid batch: random tokens, the second half trained, one advantage per sequence."""
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    loss_mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    loss_mask[:, seq_len // 2 :] = True
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "advantages": torch.randn(batch_size, generator=generator),
    }


def run_produce(config: Config) -> int:
    """``weightcast produce``: push ``count`` synthetic batches (and, if asked, bad ones)."""
    cfg = config.produce
    keys = Keys(config.common.namespace)
    client = redis.Redis.from_url(config.common.redis_url)
    producer = BatchProducer(client, keys, "weightcast-produce")
    generator = torch.Generator().manual_seed(cfg.seed)
    for index in range(1, cfg.count + 1):
        tensors = synthetic_batch(generator, cfg.batch_size, cfg.seq_len, cfg.vocab_size)
        entry = producer.push(tensors, producer.latest_version())
        log.info("pushed batch", index=index, entry=entry)
        time.sleep(cfg.interval)
        if cfg.invalid_every and index % cfg.invalid_every == 0:
            meta = {"policy_version": producer.latest_version(), "producer": producer.name}
            bad = client.xadd(
                keys.batches, {BATCH_FIELD: b"not safetensors", META_FIELD: json.dumps(meta)}
            )
            log.info("pushed a malformed batch on purpose", entry=bad.decode())
    return 0
