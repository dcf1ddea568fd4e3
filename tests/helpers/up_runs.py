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


SUMMARY_ROW = re.compile(
    r"^  v(\d+)\s+(\d+|-)\s+(?:[\d.]+s|\(uniform start\))\s+(\d+)\s+([\d.]+|-)\s+\S+$",
    re.MULTILINE,
)


def summary_rows(out: str) -> list[tuple[int, str, int, str]]:
    """``up``'s summary table: (version, step or ``-``, rollout batches, mean reward or ``-``)
    of each version, v0 (the uniform start) first when the node sampled from it."""
    return [(int(v), step, int(n), r) for v, step, n, r in SUMMARY_ROW.findall(out)]


def start_and_late_reward(out: str) -> tuple[float, float]:
    """The mean reward where the run started and over the last third of the versions sampled.

    The start is v0, the uniform policy the node samples before any version reaches it (the
    lowest version sampled when it had none): its reward is ``target_below / vocab_size`` =
    1/32 in expectation. Not the first third of the versions: at up's rate the policy can reach
    a reward of 1 within 8 versions, and a first third of 28 versions then averaged 0.53 while
    the run learned all it could (CI, stop 47).
    """
    batches = {v: (n, float(r)) for v, _, n, r in summary_rows(out) if r != "-"}
    sampled = sorted(batches)
    assert len(sampled) >= 4, out
    late = sampled[-max(1, (len(sampled) - 1) // 3) :]
    total = sum(batches[v][0] for v in late)
    return batches[sampled[0]][1], sum(batches[v][0] * batches[v][1] for v in late) / total


def mismatch_kl(trainer_log: str) -> list[tuple[float, int]]:
    """The trainer's ``mismatch_kl`` of each on-policy step, with the version it was of."""
    found = re.findall(
        r"step step=\d+ .*mismatch_kl=([\d.e+-]+) .*mismatch_version=(\d+)", trainer_log
    )
    return [(float(kl), int(v)) for kl, v in found]


__all__ = ["MAIN_PYTHON", "mismatch_kl", "run_up", "start_and_late_reward", "summary_rows"]
