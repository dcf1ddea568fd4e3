"""Rollouts for a toy, verifiable RL task: sample from the served policy, score, push.

An inference node running ``weightcast follow --rollout`` is also the rollout producer. For
each batch it draws random prompts, samples a GRPO group of completions per prompt from the
newest version it has loaded (transformers' ``Qwen3ForCausalLM`` on CPU, fp32; an FP8
version's weights dequantized), keeps the log-probability of every sampled token (the
trainer's ``old_logprobs``), scores each completion with :func:`toy_reward`, turns rewards
into group-relative advantages and pushes the batch tagged with the version it sampled from.

Before version 1 exists there is nothing to load, so version 0 is the uniform policy over the
vocabulary: its log-probabilities are exact (``-ln V``), so the trainer's importance ratios
are right from the first batch, and a freshly initialised model is close to it anyway.

The math is in pure functions (:func:`toy_reward`, :func:`group_advantages`,
:func:`rollout_tensors`); the policies and the loop do the I/O.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightcast.client.node import Node
from weightcast.client.producer import BatchProducer
from weightcast.contract import fp8
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.fusion import unfuse
from weightcast.contract.model_shape import ModelShape
from weightcast.local.policy import Policy
from weightcast.local.settings import RolloutConfig
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import Outage
from weightcast.runtime.stop import Stop

log = get_logger("rollout")

_IDLE_S = 0.05
"""How long the rollout loop sleeps when the queue is full (it rechecks versions meanwhile)."""


@dataclass
class UniformPolicy:
    """Version 0: every token equally likely, before any version is published."""

    vocab_size: int
    version: int = 0

    def sample(
        self, prompts: torch.Tensor, length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab_size, (prompts.shape[0], length), generator=generator)
        return tokens, torch.full(tokens.shape, -math.log(self.vocab_size))


class ModelPolicy:
    """A published version in transformers' ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM``
    when its ``config.json`` has a mixture of experts' fields), sampled with a KV cache."""

    def __init__(self, version: int, config: Mapping[str, Any], hf_tensors: dict[str, Any]):
        try:
            from transformers import (
                Qwen3Config,
                Qwen3ForCausalLM,
                Qwen3MoeConfig,
                Qwen3MoeForCausalLM,
            )
        except ImportError as exc:
            raise ImportError(
                "the rollout node samples with transformers, which is not installed: "
                "pip install 'weightcast[demo]'"
            ) from exc

        self.version = version
        self.vocab_size = int(config["vocab_size"])
        # the model's fields, not its architectures: a fused version's config.json names
        # weightcast's marker architecture
        moe = ModelShape.from_hf_config(config).moe
        config_cls, model_cls = (
            (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
        )
        hf_config = config_cls.from_dict({**config, "torch_dtype": "float32"})
        state = {name: t.float() for name, t in hf_tensors.items()}
        # from_pretrained, not load_state_dict: transformers 5 holds an MoE's experts stacked
        # and turns HF's per-expert tensors into them as it loads them
        misfit = f"version {version} does not fit {model_cls.__name__}"
        try:
            self.model, info = model_cls.from_pretrained(
                None,
                config=hf_config,
                state_dict=state,
                dtype=torch.float32,
                output_loading_info=True,
            )
        except RuntimeError as exc:  # an expert's tensors that do not stack, a wrong shape
            raise WeightsError(f"{misfit}: {str(exc).splitlines()[0]}") from None
        self.model.eval()
        tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
        missing, unexpected = sorted(set(info["missing_keys"]) - tied), info["unexpected_keys"]
        if missing or unexpected or info["mismatched_keys"]:
            raise WeightsError(
                f"{misfit}: missing {missing}, unexpected {sorted(unexpected)}, "
                f"mismatched {sorted(info['mismatched_keys'])}"
            )

    @classmethod
    def from_published(
        cls, version: int, config: Mapping[str, Any], tensors: dict[str, torch.Tensor], tp: int
    ) -> ModelPolicy:
        """Build from a version's ``config.json`` and its vllm-fused tensors. An FP8 version
        (``publisher.quantize fp8``) is dequantized in float32, so the node samples with the
        values an FP8 engine computes with (not with FP8 arithmetic: the matmuls stay fp32)."""
        weights = fp8.dequantize_checkpoint(tensors, torch.float32, tp)
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        return cls(version, plain, unfuse(weights, ModelShape.from_hf_config(config), tp))

    @torch.inference_mode()
    def sample(
        self, prompts: torch.Tensor, length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache()  # filled in place; the 4th argument in transformers 4 and 5
        logits = self.model(prompts.long(), None, None, cache, use_cache=True).logits
        tokens, logprobs = [], []
        for _ in range(length):
            logp = torch.log_softmax(logits[:, -1].float(), dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=generator)
            tokens.append(token)
            logprobs.append(logp.gather(1, token))
            logits = self.model(token, None, None, cache, use_cache=True).logits
        return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)


def toy_reward(completions: torch.Tensor, target_below: int) -> torch.Tensor:
    """``[N]`` fraction of each completion's tokens with an id below ``target_below``."""
    return (completions < target_below).float().mean(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's standard deviation.

    Rewards come in consecutive groups of ``group_size`` (one prompt each); a group whose
    completions all score the same teaches nothing and gets zero advantages.
    """
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return (centred / (groups.std(dim=1, keepdim=True) + eps)).view(-1)


def rollout_tensors(
    prompts: torch.Tensor,
    completions: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The batch the trainer reads: prompt + completion, trained on the completion only.

    ``prompts`` is ``[N, P]`` (already repeated per group member), the rest ``[N, C]`` and
    ``[N]``. Every per-token tensor is ``[N, P + C]``, aligned with ``input_ids``.
    """
    prompt_len = prompts.shape[1]
    input_ids = torch.cat([prompts, completions], dim=1).to(torch.int32)
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    old_logprobs = torch.zeros(input_ids.shape, dtype=torch.float32)
    old_logprobs[:, prompt_len:] = logprobs
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "advantages": advantages.float(),
        "old_logprobs": old_logprobs,
    }


@dataclass(frozen=True)
class Rollout:
    tensors: dict[str, torch.Tensor]
    reward: float
    """Mean reward of the batch's completions."""


def sample_rollout(policy: Policy, cfg: RolloutConfig, generator: torch.Generator) -> Rollout:
    """One batch of the toy task from ``policy``."""
    prompts = torch.randint(
        0, policy.vocab_size, (cfg.prompts, cfg.prompt_len), generator=generator
    ).repeat_interleave(cfg.group_size, dim=0)
    completions, logprobs = policy.sample(prompts, cfg.completion_len, generator)
    rewards = toy_reward(completions, cfg.target_below)
    advantages = group_advantages(rewards, cfg.group_size)
    return Rollout(
        rollout_tensors(prompts, completions, logprobs, advantages), rewards.mean().item()
    )


class RolloutLoop:
    """Keeps the trainer fed: when there is room in the queue, sample from the newest policy.

    ``refresh`` returns a newer policy when one has been published (or None), ``has_room``
    says whether the queue takes another batch, ``push`` sends one. A batch whose push
    fails (Redis unreachable or full) is kept and pushed by a later step, not sampled again.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        refresh: Callable[[Policy], Policy | None],
        has_room: Callable[[], bool],
        push: Callable[[Rollout, int], str],
    ) -> None:
        self.cfg = cfg
        self.refresh = refresh
        self.has_room = has_room
        self.push = push
        self.policy: Policy = UniformPolicy(cfg.vocab_size)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.batches = 0
        self.unpushed: tuple[Rollout, int] | None = None
        """A sampled batch and the version it came from, not pushed yet."""

    def step(self) -> bool:
        """Push one batch if the queue has room; False when it had none (caller waits)."""
        newer = self.refresh(self.policy)
        if newer is not None:
            self.policy = newer
        if not self.has_room():
            return False
        start = time.perf_counter()
        if self.unpushed is None:
            self.unpushed = (
                sample_rollout(self.policy, self.cfg, self.generator),
                self.policy.version,
            )
        rollout, version = self.unpushed
        entry = self.push(rollout, version)
        self.unpushed = None
        self.batches += 1
        log.info(
            "pushed rollout batch",
            entry=entry,
            policy_version=version,
            reward=round(rollout.reward, 4),
            seconds=round(time.perf_counter() - start, 3),
        )
        return True


def run_rollout_node(config: Config, node: Node, stop: Stop, outage: Outage) -> int:
    """Load each new version and keep the trainer fed with rollouts from the newest one.

    Redis outages and a full Redis (the trainer is not consuming) are waited out through
    ``outage``: the batch in hand is kept and pushed once Redis takes it.
    """
    cfg = config.rollout
    producer = BatchProducer(
        config.common.redis_url,
        config.common.namespace,
        name=node.client.node_id,
        max_pending=cfg.max_pending,
        timeout=cfg.timeout,
    )

    def load_in_transformers(policy: Policy) -> Policy | None:
        latest = node.client.latest()
        if latest <= max(policy.version, node.seen):
            return None
        loaded = node.load(latest)
        if loaded is None:
            return None
        try:
            return ModelPolicy.from_published(
                loaded.version, loaded.config, loaded.tensors, loaded.info.tp
            )
        except (LayoutError, WeightsError) as exc:
            log.error("refusing version: it does not fit the rollout model", reason=str(exc))
            return None

    refresh = load_in_transformers
    if cfg.engine == "vllm":
        from weightcast.local.vllm_rollout import VllmPolicies

        refresh = VllmPolicies(config, node).refresh
    elif cfg.engine == "sglang":
        from weightcast.local.sglang_rollout import SglangPolicies

        refresh = SglangPolicies(config, node).refresh

    def push(rollout: Rollout, version: int) -> str:
        return producer.push(rollout.tensors, version, reward=rollout.reward)

    loop = RolloutLoop(cfg, refresh, producer.has_room, push)
    log.info("producing rollouts", max_pending=cfg.max_pending, group_size=cfg.group_size)
    idle_since = time.monotonic()
    progressed = False

    def step() -> None:
        nonlocal progressed
        node.report()
        progressed = loop.step()

    try:
        while not stop.is_set():
            if not outage.attempt(step, "producing rollouts", stop.wait):
                idle_since = time.monotonic()  # waiting for Redis is not the trainer idling
            elif progressed:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > cfg.timeout:
                raise producer.timed_out(producer.undelivered())
            else:
                stop.wait(_IDLE_S)
    finally:
        producer.close()
    return 0
