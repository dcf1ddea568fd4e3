"""``weightcast up --engine vllm``: the RL loop with rollouts sampled by a real vLLM engine.

``up`` runs from the main venv (the trainer needs torchtitan); it starts the rollout node with
the vLLM venv's Python, where the node samples from a CPU ``vllm.LLM`` that the weightcast
backend brings to every new version. The reward must still rise.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch

from helpers.files import REPO
from helpers.models import save_pretrained_qwen3
from helpers.processes import clean_env

MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
STEPS = 40  # as `weightcast up` runs by default: under load 30 steps left the late third near 0.3


def run_up(workdir: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``weightcast up --engine vllm`` from the main venv; its result and run directory."""
    assert MAIN_PYTHON.is_file(), "make setup builds the main venv, which runs the trainer"
    result = subprocess.run(
        [str(MAIN_PYTHON), "-m", "weightcast", "up", "--engine", "vllm", *flags],
        env=clean_env(),
        cwd=REPO,  # where up finds .venv-vllm/bin/python
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (run_dir,) = workdir.glob("2*")
    return result, run_dir


def test_up_samples_with_vllm_and_the_reward_rises(tmp_path: Path) -> None:
    flags = ["--steps", str(STEPS), "--workdir", str(tmp_path), "--timeout", "1500"]
    result, run_dir = run_up(tmp_path, *flags)
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

    rows = re.findall(
        r"^  v(\d+)\s+(\d+|-)\s+(?:[\d.]+s|\(uniform start\))\s+(\d+)\s+([\d.]+|-)\s+\S+$",
        out,
        re.MULTILINE,
    )
    batches = {int(v): (int(n), float(r)) for v, _, n, r in rows if r != "-"}
    sampled = sorted(v for v in batches if v > 0)  # v0: the uniform policy before any version
    assert len(sampled) >= 4, out
    third = max(1, len(sampled) // 3)

    def mean_reward(group: list[int]) -> float:
        total = sum(batches[v][0] for v in group)
        return sum(batches[v][0] * batches[v][1] for v in group) / total

    early, late = mean_reward(sampled[:third]), mean_reward(sampled[-third:])
    assert late > 0.3 and late > 2 * early, out


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
    result, run_dir = run_up(workdir, *flags)
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert result.returncode == 0, result.stdout + result.stderr + trainer_log[-5000:]
    assert "started from a checkpoint" in trainer_log and "published the start" in trainer_log
    found = re.findall(
        r"step step=\d+ .*mismatch_kl=([\d.e+-]+) .*mismatch_version=(\d+)", trainer_log
    )
    assert len(found) >= 3, trainer_log[-5000:]
    worst = max(float(kl) for kl, _ in found)
    print(f"on-policy steps {len(found)}, largest mismatch_kl {worst:.3e}")
    assert worst <= MISMATCH_BOUND, found
    assert "train/infer KL" in result.stdout
