"""``weightcast up --engine <engine>`` from the main venv, and what its output says (the vLLM
and SGLang tiers' ``up`` tests)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from helpers.files import REPO
from helpers.processes import clean_env

MAIN_PYTHON = REPO / ".venv" / "bin" / "python"


def run_up(
    engine: str, workdir: Path, *flags: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``weightcast up --engine <engine>`` from the main venv; its result and run directory."""
    assert MAIN_PYTHON.is_file(), "make setup builds the main venv, which runs the trainer"
    result = subprocess.run(
        [str(MAIN_PYTHON), "-m", "weightcast", "up", "--engine", engine, *flags],
        env=clean_env(),
        cwd=REPO,  # where up finds the engine's venv (.venv-vllm, .venv-sglang)
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (run_dir,) = workdir.glob("2*")
    return result, run_dir


def reward_by_version(out: str) -> dict[int, tuple[int, float]]:
    """``up``'s summary table: (rollout batches, mean reward) of each version sampled from."""
    rows = re.findall(
        r"^  v(\d+)\s+(\d+|-)\s+(?:[\d.]+s|\(uniform start\))\s+(\d+)\s+([\d.]+|-)\s+\S+$",
        out,
        re.MULTILINE,
    )
    return {int(v): (int(n), float(r)) for v, _, n, r in rows if r != "-"}


def early_and_late_reward(out: str) -> tuple[float, float]:
    """The mean reward of the first and of the last third of the versions sampled from (v0,
    the uniform policy before any version, left out)."""
    batches = reward_by_version(out)
    sampled = sorted(v for v in batches if v > 0)
    assert len(sampled) >= 4, out
    third = max(1, len(sampled) // 3)

    def mean_reward(group: list[int]) -> float:
        total = sum(batches[v][0] for v in group)
        return sum(batches[v][0] * batches[v][1] for v in group) / total

    return mean_reward(sampled[:third]), mean_reward(sampled[-third:])


def mismatch_kl(trainer_log: str) -> list[tuple[float, int]]:
    """The trainer's ``mismatch_kl`` of each on-policy step, with the version it was of."""
    found = re.findall(
        r"step step=\d+ .*mismatch_kl=([\d.e+-]+) .*mismatch_version=(\d+)", trainer_log
    )
    return [(float(kl), int(v)) for kl, v in found]


__all__ = ["MAIN_PYTHON", "early_and_late_reward", "mismatch_kl", "run_up"]
