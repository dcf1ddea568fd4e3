"""``weightcast produce``: a stand-in rollout producer that pushes synthetic batches.

Good batches are random tokens with the second half trained, their ``meta.index`` counting
from 1; with ``--invalid-every`` it also pushes malformed ones on purpose, to show the
dead-letter path. A Redis outage is ridden out (``redis_retry_seconds``), a full Redis is a
one-line error.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import TypeVar

import redis
import torch

from weightcast.client.producer import BatchProducer
from weightcast.contract.codec import BATCH_FIELD, META_FIELD
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import Outage, full_error, redis_full

T = TypeVar("T")

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
    outage = Outage(budget=config.common.redis_retry_seconds)
    generator = torch.Generator().manual_seed(cfg.seed)

    def push_good(tensors: dict[str, torch.Tensor], index: int) -> str:
        return producer.push(tensors, producer.latest_version(), index=index)

    def push_malformed() -> str:
        meta = {"policy_version": producer.latest_version(), "producer": producer.name}
        fields = {BATCH_FIELD: b"not safetensors", META_FIELD: json.dumps(meta)}
        return producer.redis.xadd(producer.keys.batches, fields).decode()

    for index in range(1, cfg.count + 1):
        tensors = synthetic_batch(generator, cfg.batch_size, cfg.seq_len, cfg.vocab_size)
        push = functools.partial(push_good, tensors, index)
        entry = _through_outages(outage, push, f"pushing batch {index}")
        log.info("pushed batch", index=index, entry=entry)
        time.sleep(cfg.interval)
        if cfg.invalid_every and index % cfg.invalid_every == 0:
            bad = _through_outages(outage, push_malformed, "pushing a malformed batch")
            log.info("pushed a malformed batch on purpose", entry=bad)
    producer.close()
    return 0


def _through_outages(outage: Outage, push: Callable[[], T], what: str) -> T:
    """``push()``, retried while Redis is unreachable; a full Redis ends the run: nothing
    here would make room (only a trainer trimming the stream or an operator can)."""
    try:
        return outage.call(push, what)
    except redis.ResponseError as exc:
        if redis_full(exc):
            raise full_error(exc, what) from None
        raise
