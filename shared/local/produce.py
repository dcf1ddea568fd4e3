"""``weightcast produce``: a stand-in rollout producer that pushes synthetic batches.

Good batches are random tokens with the second half trained; with ``--invalid-every`` it
also pushes malformed ones on purpose, to show the dead-letter path.
"""

from __future__ import annotations

import json
import time

import torch

from weightcast.client.producer import BatchProducer
from weightcast.contract.codec import BATCH_FIELD, META_FIELD
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger

log = get_logger("produce")


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
    producer = BatchProducer(
        config.common.redis_url,
        config.common.namespace,
        name="weightcast-produce",
        max_pending=cfg.max_pending,
        timeout=cfg.timeout,
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    for index in range(1, cfg.count + 1):
        tensors = synthetic_batch(generator, cfg.batch_size, cfg.seq_len, cfg.vocab_size)
        entry = producer.push(tensors, producer.latest_version())
        log.info("pushed batch", index=index, entry=entry)
        time.sleep(cfg.interval)
        if cfg.invalid_every and index % cfg.invalid_every == 0:
            meta = {"policy_version": producer.latest_version(), "producer": producer.name}
            bad = producer.redis.xadd(
                producer.keys.batches,
                {BATCH_FIELD: b"not safetensors", META_FIELD: json.dumps(meta)},
            )
            log.info("pushed a malformed batch on purpose", entry=bad.decode())
    producer.close()
    return 0
