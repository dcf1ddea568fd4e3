"""The toy RL task's math and sampler (the loop itself runs in tests/test_up.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from weightcast.contract import fp8
from weightcast.contract.codec import BatchLimits, validate_tensors
from weightcast.contract.errors import WeightsError
from weightcast.contract.experts import is_expert_source, plan_experts
from weightcast.contract.fusion import FusedTensor, assemble, plan_vllm_fused
from weightcast.contract.layout import FUSED_ARCHITECTURE
from weightcast.contract.plan import plan_version
from weightcast.local.rollout import (
    ModelPolicy,
    UniformPolicy,
    group_advantages,
    sample_rollout,
    toy_reward,
)
from weightcast.local.settings import RolloutConfig
from weightcast_trainer.loss import token_logprobs

from helpers.fp8_versions import fp8_sources, published, quantized_checkpoint
from helpers.models import checkpoint_tensors, hf_state, moe_shape, save_pretrained_qwen3, shape_of

SHAPE = shape_of(4, 2, 16, hidden=32, inter=64)


def config() -> dict:
    return {**SHAPE.to_hf_config(), "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def test_reward_is_the_fraction_of_target_tokens() -> None:
    completions = torch.tensor([[0, 5, 40, 63], [40, 41, 42, 43]])
    assert toy_reward(completions, target_below=32).tolist() == [0.5, 0.0]


def test_group_advantages_are_relative_to_the_group() -> None:
    rewards = torch.tensor([0.0, 0.5, 1.0, 0.5, 0.2, 0.2, 0.2, 0.2])
    advantages = group_advantages(rewards, group_size=4)
    first, second = advantages.view(2, 4)
    assert abs(first.sum().item()) < 1e-5 and first.argmax() == 2 and first.argmin() == 0
    assert first[1].item() == first[3].item() == 0.0
    assert torch.equal(second, torch.zeros(4))  # a group that all scored the same teaches nothing


def test_a_rollout_is_a_valid_batch_trained_on_the_completion_only() -> None:
    cfg = RolloutConfig(prompts=2, group_size=3, prompt_len=4, completion_len=5, vocab_size=64)
    rollout = sample_rollout(UniformPolicy(64), cfg, torch.Generator().manual_seed(0))
    tensors = rollout.tensors
    validate_tensors(tensors, BatchLimits(vocab_size=64, max_seq_len=9))
    assert tensors["input_ids"].shape == (6, 9)
    prompts = tensors["input_ids"][:, :4].view(2, 3, 4)
    assert torch.equal(prompts[:, 0], prompts[:, 2])  # one prompt per group
    assert tensors["loss_mask"][:, :4].sum() == 0 and tensors["loss_mask"][:, 4:].all()
    assert torch.allclose(tensors["old_logprobs"][:, 4:], torch.tensor(-math.log(64)))
    assert tensors["old_logprobs"][:, :4].abs().sum() == 0
    expected = toy_reward(tensors["input_ids"][:, 4:], cfg.target_below).mean().item()
    assert rollout.reward == expected


def test_sampled_logprobs_are_what_the_trainer_computes_for_the_same_weights() -> None:
    """``old_logprobs`` from the KV-cached sampler equal teacher-forced log-probabilities."""
    policy = ModelPolicy(3, config(), hf_state(SHAPE))
    prompts = torch.randint(0, SHAPE.vocab_size, (4, 5), generator=torch.Generator().manual_seed(1))
    completions, logprobs = policy.sample(prompts, 6, torch.Generator().manual_seed(2))
    sequence = torch.cat([prompts, completions], dim=1)
    with torch.no_grad():
        teacher = token_logprobs(policy.model(sequence).logits, sequence)
    assert torch.allclose(teacher[:, 5:], logprobs, atol=1e-5)
    assert not torch.allclose(logprobs, torch.tensor(-math.log(SHAPE.vocab_size)), atol=1e-3)


def test_a_policy_built_from_published_fused_tensors_is_the_hf_model() -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    plan = plan_vllm_fused({n: t.shape[0] for n, t in state.items()}, SHAPE, 2)
    published = {p.name: assemble(p, state) for p in plan}
    direct = ModelPolicy(1, config(), state)
    rebuilt = ModelPolicy.from_published(1, config(), published, tp=2)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(direct.model(ids).logits, rebuilt.model(ids).logits)


def test_a_policy_built_from_a_published_fp8_version_samples_its_dequantized_weights() -> None:
    """An FP8 version (fused at tp 2, its config.json with ``quantization_config``) builds the
    model of its dequantized weights in float32, which differs from the bf16 weights it
    was quantized from: the node samples with what an FP8 engine computes with."""
    shape = shape_of(2, 2, 128, hidden=128, inter=256)
    weights, checkpoint = quantized_checkpoint(shape, seed=4)
    version = published(plan_version(fp8_sources(shape), shape, 2), checkpoint)
    hf = {**shape.to_hf_config(), "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    rebuilt = ModelPolicy.from_published(1, fp8.quantized_config(hf), version, tp=2)
    dequantized = ModelPolicy(1, hf, fp8.dequantize_checkpoint(checkpoint, torch.float32))
    source = ModelPolicy(1, hf, weights)
    ids = torch.randint(0, shape.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = rebuilt.model(ids).logits
        assert torch.equal(logits, dequantized.model(ids).logits)
        assert not torch.allclose(logits, source.model(ids).logits, atol=1e-5)


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (2, 2)])
def test_a_policy_built_from_a_published_moe_version_is_the_hf_model(tp: int, ep: int) -> None:
    """A fused MoE version (its config.json names weightcast's marker architecture) builds
    ``Qwen3MoeForCausalLM`` with the HF weights: the experts unfused, whatever the placement."""
    shape = moe_shape()
    state = hf_state(shape, torch.bfloat16)
    rows = {n: t.shape[0] for n, t in state.items()}
    dense = plan_vllm_fused({n: r for n, r in rows.items() if not is_expert_source(n)}, shape, tp)
    published = {p.name: assemble(p, state) for p in dense} | {
        p.name: assemble(FusedTensor(p.name, p.pieces, p.shard), state).reshape(p.shape)
        for p in plan_experts(rows, shape, tp, ep)
    }
    hf = {**shape.to_hf_config(), "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    direct = ModelPolicy(1, hf, state)
    rebuilt = ModelPolicy.from_published(
        1, {**hf, "architectures": [FUSED_ARCHITECTURE]}, published, tp
    )
    assert type(rebuilt.model).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, shape.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(direct.model(ids).logits, rebuilt.model(ids).logits)


def test_an_moe_policy_is_the_checkpoint_transformers_loads(tmp_path: Path) -> None:
    """A Qwen3-MoE version (one tensor per expert, a dense layer among sparse ones) samples
    from ``Qwen3MoeForCausalLM`` with exactly the checkpoint's weights, and its sampled
    log-probabilities are the teacher-forced ones."""
    from transformers import Qwen3MoeForCausalLM

    start = save_pretrained_qwen3(tmp_path / "start", "moe-untied-odd", torch.float32)
    config = json.loads((start / "config.json").read_text())
    policy = ModelPolicy(2, config, checkpoint_tensors(start))
    reference = Qwen3MoeForCausalLM.from_pretrained(start).eval()
    prompts = torch.randint(0, 1003, (3, 4), generator=torch.Generator().manual_seed(1))
    completions, logprobs = policy.sample(prompts, 5, torch.Generator().manual_seed(2))
    sequence = torch.cat([prompts, completions], dim=1)
    with torch.no_grad():
        ours = policy.model(sequence).logits
        assert torch.equal(ours, reference(sequence).logits)
    assert torch.allclose(token_logprobs(ours, sequence)[:, 4:], logprobs, atol=1e-5)


def test_a_version_that_does_not_fit_the_moe_is_refused(tmp_path: Path) -> None:
    start = save_pretrained_qwen3(tmp_path / "start", "moe-untied-odd", torch.float32)
    config = json.loads((start / "config.json").read_text())
    tensors = checkpoint_tensors(start)
    expert = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(WeightsError, match=r"^version 2 does not fit Qwen3MoeForCausalLM: "):
        ModelPolicy(2, config, {n: t for n, t in tensors.items() if n != expert})
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].T
    with pytest.raises(WeightsError, match=r"^version 2 does not fit Qwen3MoeForCausalLM: "):
        ModelPolicy(2, config, tensors)
