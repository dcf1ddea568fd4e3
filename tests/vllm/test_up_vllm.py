"""``weightcast up --engine vllm``: the RL loop with rollouts sampled by a real vLLM engine.

``up`` runs from the main venv (the trainer needs torchtitan); it starts the rollout node with
the vLLM venv's Python, where the node samples from a CPU ``vllm.LLM`` that the weightcast
backend brings to every new version. The reward must still rise.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from helpers.models import save_pretrained_qwen3
from helpers.up_runs import mismatch_kl, run_up, start_and_late_reward

STEPS = 40  # as `weightcast up` runs by default: under load 30 steps left the late third near 0.3


def test_up_samples_with_vllm_and_the_reward_rises(tmp_path: Path) -> None:
    flags = ["--steps", str(STEPS), "--workdir", str(tmp_path), "--timeout", "1500"]
    result, run_dir = run_up("vllm", tmp_path, *flags)
    node_log = (run_dir / "logs" / "follower.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + node_log[-5000:]
    out = result.stdout

    # The node was the vLLM one, and every version reached its engine through the backend.
    assert "started a vllm engine" in node_log
    loaded = re.findall(r"vllm engine serves version .*version=(\d+)", node_log)
    backend = re.findall(r"weightcast: loaded \{'version': (\d+), .*'mode': 'layerwise'", node_log)
    assert loaded and [int(v) for v in backend] == [int(v) for v in loaded]
    count = int(re.search(r"(\d+) versions published", out)[1])
    assert f"the inference node loaded v{count};" in out

    start, late = start_and_late_reward(out)
    assert start < 0.15 and late > 0.3, out


MISMATCH_BOUND = 1e-3


def test_up_from_a_checkpoint_serves_the_trainers_weights(tmp_path: Path) -> None:
    """``up --engine vllm --init-from DIR``: the engine starts on the first version (the
    checkpoint itself), and every batch it samples from the version holding the trainer's
    current weights scores a train/inference mismatch of at most 1e-3 (``max_policy_lag`` 0
    and a version every step make such batches the common case)."""
    start = save_pretrained_qwen3(tmp_path / "start", "untied-odd", torch.bfloat16, scale=4.0)
    config = tmp_path / "lag0.toml"
    # An RL-like rate: at up's 1e-2 the toy task collapses the policy within 20 steps
    # (entropy < 0.3 nats), and a bf16 engine's log-probability of a token the fp32 trainer
    # gives 1e-9 is off by nats: numerics of a degenerate policy, not a wrong load.
    config.write_text("[trainer]\nmax_policy_lag = 0\nlr = 1e-4\n")
    workdir = tmp_path / "runs"
    flags = ["--init-from", str(start), "--steps", "24", "--publish-every", "1"]
    flags += ["--config", str(config), "--workdir", str(workdir), "--timeout", "1500"]
    result, run_dir = run_up("vllm", workdir, *flags)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + trainer_log[-5000:]
    assert "started from a checkpoint" in trainer_log and "published the start" in trainer_log
    found = mismatch_kl(trainer_log)
    assert len(found) >= 3, trainer_log[-5000:]
    worst = max(kl for kl, _ in found)
    print(f"on-policy steps {len(found)}, largest mismatch_kl {worst:.3e}")
    assert worst <= MISMATCH_BOUND, found
    assert "train/infer KL" in result.stdout
