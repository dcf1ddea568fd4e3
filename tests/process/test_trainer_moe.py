"""The ``tiny-moe`` flavor end to end on the trainer's side: it trains, and the version the
publisher makes of its snapshot (``--layout hf``) is a Qwen3-MoE checkpoint that
transformers loads whole, under exactly the names and shapes its own ``save_pretrained``
writes (one tensor per expert)."""

from __future__ import annotations

import json
from pathlib import Path

import redis
import torch

from weightcast.contract.keys import Keys

from helpers.models import checkpoint_tensors
from helpers.processes import run_weightcast
from helpers.redis_state import push_batches


def test_the_tiny_moe_flavor_trains_and_publishes_a_checkpoint_transformers_loads(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 2, vocab_size=1024)
    trained = run_weightcast(cli_env, "trainer", "--model", "tiny-moe", "--steps", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    published = run_weightcast(cli_env, "publisher", "--layout", "hf", "--once")
    assert published.returncode == 0, published.stderr[-3000:]
    version = tmp_path / "weights" / "v1"
    config = json.loads((version / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8

    reference = tmp_path / "reference"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).save_pretrained(reference)
    ours, theirs = checkpoint_tensors(version), checkpoint_tensors(reference)
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in theirs.items()}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours

    model, info = Qwen3MoeForCausalLM.from_pretrained(version, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert all(torch.isfinite(p).all() for p in model.parameters())
