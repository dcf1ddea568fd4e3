"""``weightcast up --engine vllm``: the RL loop with rollouts sampled by a real vLLM engine.

``up`` runs from the main venv (the trainer needs torchtitan); it starts the rollout node with
the vLLM venv's Python, where the node samples from a CPU ``vllm.LLM`` that the weightcast
backend brings to every new version. The reward must still rise.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from helpers import REPO, clean_env

MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
STEPS = 40  # as `weightcast up` runs by default: under load 30 steps left the late third near 0.3


def test_up_samples_with_vllm_and_the_reward_rises(tmp_path: Path) -> None:
    assert MAIN_PYTHON.is_file(), "make setup builds the main venv, which runs the trainer"
    flags = ["--steps", str(STEPS), "--workdir", str(tmp_path), "--timeout", "1500"]
    result = subprocess.run(
        [str(MAIN_PYTHON), "-m", "weightcast", "up", "--engine", "vllm", *flags],
        env=clean_env(),
        cwd=REPO,  # where up finds .venv-vllm/bin/python
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (run_dir,) = tmp_path.iterdir()
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
        r"^  v(\d+)\s+(\d+|-)\s+(?:[\d.]+s|\(uniform start\))\s+(\d+)\s+([\d.]+|-)$",
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
