"""An engine started from a user's ``save_pretrained`` directory serves exactly the weights
weightcast hands it, and the train/inference mismatch check tells a right load from a wrong one.

The trainer side of the check is ``transformers``' fp32 ``Qwen3ForCausalLM`` of the same
directory (torchtitan does not install beside vLLM; tests/process/test_reference shows the two
agree to 1e-4 in fp32), scored with the trainer's own
:func:`~weightcast_trainer.loss.logprob_mismatch` on the engine's log-probabilities of the
same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from weightcast.client.vllm.engine import swap
from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.loss import logprob_mismatch

from helpers.models import checkpoint_tensors, save_pretrained_qwen3
from vllm_helpers import Registry, backend_engine

GOOD_KL_BOUND = 1e-3
BROKEN_FACTOR = 100


def swap_q_heads(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Layer 0's q rows of its first head and of the first head of the next kv group
    exchanged: what a fused file with those rows swapped by hand puts into the engine (the
    publisher fuses q_proj's rows into qkv_proj as they are). Heads of one kv group would
    differ little under a near-uniform attention; across groups they read other values."""
    d = config["head_dim"]
    other = config["num_attention_heads"] // config["num_key_value_heads"]
    broken = dict(state)
    q = state["model.layers.0.self_attn.q_proj.weight"].clone()
    first, second = q[:d].clone(), q[other * d : (other + 1) * d].clone()
    q[:d], q[other * d : (other + 1) * d] = second, first
    broken["model.layers.0.self_attn.q_proj.weight"] = q
    return broken


def engine_logprobs(llm: Any, prompts: torch.Tensor) -> torch.Tensor:
    """The engine's log-probability of every prompt token (0 for the first)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False
    )
    rows = [
        [0.0 if d is None else d[t].logprob for t, d in zip(p, o.prompt_logprobs, strict=True)]
        for p, o in zip(prompts.tolist(), outputs, strict=True)
    ]
    return torch.tensor(rows)


def mismatch_kl(logits: torch.Tensor, prompts: torch.Tensor, old: torch.Tensor) -> float:
    """The trainer's ``mismatch_kl``: mean k3 KL per trained token (every token but the first)."""
    mask = torch.ones(prompts.shape)
    batch = RolloutBatch(
        input_ids=prompts,
        loss_mask=mask,
        advantages=torch.zeros(prompts.shape),
        old_logprobs=old,
        meta={"policy_version": 1, "producer": "test"},
    )
    found = logprob_mismatch(logits, batch)
    assert found is not None
    return found.kl.item() / found.tokens


def test_the_mismatch_check_tells_a_right_load_from_two_swapped_q_heads(
    registry: Registry, tmp_path: Path
) -> None:
    from transformers import Qwen3ForCausalLM

    start = save_pretrained_qwen3(tmp_path / "start", "untied-odd", torch.bfloat16, scale=4.0)
    config = json.loads((start / "config.json").read_text())
    state = checkpoint_tensors(start)
    right = registry.publish(config, state)
    wrong = registry.publish(config, swap_q_heads(state, config))
    prompts = torch.randint(
        0, config["vocab_size"], (4, 48), generator=torch.Generator().manual_seed(0)
    )
    trainer = Qwen3ForCausalLM.from_pretrained(start, dtype=torch.float32)
    with torch.no_grad():
        logits = trainer(prompts).logits
    figures = {}
    with backend_engine(start, registry, "mismatch-node") as engine:
        for name, version in (("right", right), ("wrong", wrong)):
            swap(engine, version)
            figures[name] = mismatch_kl(logits, prompts, engine_logprobs(engine.llm, prompts))
    print(f"mismatch_kl: right {figures['right']:.3e}, wrong {figures['wrong']:.3e}")
    assert figures["right"] <= GOOD_KL_BOUND, figures
    assert figures["wrong"] >= BROKEN_FACTOR * figures["right"], figures
