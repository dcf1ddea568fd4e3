"""The rollout node on a real SGLang engine (``rollout.engine = sglang``, ``up --engine sglang``).

The engine (an ``sglang.Engine`` in the node's process, its scheduler in a process of its
own) starts when the first version is published, from that version's ``config.json`` with
placeholder weights (``load_format="dummy"``), and every version, the first included, reaches
it through :class:`~weightcast.client.sglang.engine.SglangNode`: leased, verified, and only the
tensors that differ from what the engine holds handed to SGLang's update API, which then
reports the version as its ``weight_version``. SGLang loads whole HF tensors, so ``up``
publishes the ``hf`` layout. Each completion is sampled at temperature 1, and SGLang returns
the log-probability of every sampled token (the trainer's ``old_logprobs``).

SGLang pins its own torch, so this runs in a Python of its own (``make sglang-setup`` builds
``.venv-sglang``); ``up`` starts the node with :func:`sglang_python`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from weightcast.client.engine import EngineError
from weightcast.client.node import Node
from weightcast.client.sglang.engine import SglangNode
from weightcast.client.sglang.local_engine import LocalSglangEngine
from weightcast.local.engine_rollout import (
    EnginePolicies,
    EnginePolicy,
    engine_python,
    gpu_here,
)
from weightcast.local.policy import Policy
from weightcast.local.settings import UpConfig
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.net import free_port

log = get_logger("rollout")

SGLANG_VENV_PYTHON = Path(".venv-sglang/bin/python")
"""The SGLang venv ``make sglang-setup`` builds in a checkout (``up.sglang_python``'s default)."""


class SglangPolicy(EnginePolicy):
    """Samples from the SGLang engine, which serves ``version``."""

    def sample(
        self, prompts: torch.Tensor, length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params = {
            "temperature": 1.0,
            "max_new_tokens": length,
            "ignore_eos": True,
        }
        outputs = self.engine.generate(
            input_ids=prompts.tolist(), sampling_params=params, return_logprob=True
        )
        tokens = [list(out["output_ids"]) for out in outputs]
        logprobs = [
            [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in outputs
        ]
        return torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float32)


class SglangPolicies(EnginePolicies):
    """The SGLang engine on the newest version, started at the first one."""

    engine_name = "sglang"
    engine_label = "SGLang"
    venv_python = SGLANG_VENV_PYTHON
    setup = "sglang-setup"

    def __init__(self, config: Config, node: Node) -> None:
        super().__init__(config, node)
        self.engine: Any = None
        self.sglang_node: SglangNode | None = None

    def load(self, version: int) -> None:
        assert self.sglang_node is not None
        self.sglang_node.load(version)
        reported = self.sglang_node.engine.weight_version()
        log.info("sglang reports weight_version", weight_version=reported)
        if reported != str(version):
            raise EngineError(f"SGLang reports weight_version {reported} after loading v{version}")

    def policy(self, version: int) -> Policy:
        return SglangPolicy(self.engine, version, self.vocab_size)

    def start_engine(self, version: int) -> None:
        """An engine of the version's model, with placeholder weights (loaded right after)."""
        import sglang

        model, config, shape = self.engine_model(version)
        rollout = self.config.rollout
        batch = rollout.prompts * rollout.group_size
        args: dict[str, Any] = {
            "model_path": str(model),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "dtype": str(config.get("torch_dtype", "bfloat16")),
            "disable_cuda_graph": True,
            "max_running_requests": batch,
            "max_total_tokens": max(
                2048, 2 * batch * (rollout.prompt_len + rollout.completion_len)
            ),
            "random_seed": rollout.seed,
            "port": free_port(),
            "log_level": "warning",
        }
        if not gpu_here():  # SGLang's CPU engine (docs/sglang.md)
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            args |= {"device": "cpu", "attention_backend": "torch_native"}
            args["mem_fraction_static"] = 0.05
        self.engine = sglang.Engine(**args)
        self.sglang_node = SglangNode(LocalSglangEngine(self.engine), self.node.client, shape)
        log.info("started an sglang engine", version=version, model=str(model))


FP8_REFUSAL = (
    "--quantize fp8 with --engine sglang: weightcast's SGLang node loads bf16 versions only "
    "(an FP8 SGLang engine on a CPU needs AMX tiles, and its update path is untested); use "
    "--engine vllm, or --engine transformers, which samples with the FP8 versions' dequantized "
    "weights"
)
"""Why ``up --engine sglang --quantize fp8`` is refused on every machine (see
:mod:`weightcast.client.sglang.staging`)."""


def sglang_python(up: UpConfig) -> str:
    """The Python for ``up --engine sglang``'s rollout node; ConfigError unless it has SGLang
    and weightcast."""
    return engine_python(
        "sglang", up.sglang_python, SGLANG_VENV_PYTHON, "sglang-setup", "--sglang-python"
    )
