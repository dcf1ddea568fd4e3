"""``bench/gpu.sh --dry``: the GPU machine's script, its steps on tiny shapes and the CPU, so
that it cannot rot between the rare runs on a GPU (about a minute and a half)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.files import REPO
from helpers.processes import clean_env

STEPS = ["trainer", "publish-tp1", "publish-tp2", "inplace", "freshness-tp1", "freshness-tp2"]
HANG_S = 3600
"""Only a hang: ``--dry`` has no time budget, and a step is killed only after 15 minutes, so a
loaded machine's slow steps still pass (what they must produce is asserted, not how fast)."""


def test_the_dry_run_runs_every_step_and_writes_each_steps_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**clean_env(), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--dry", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["dry"] and report["errors"] == {}
    assert list(report["seconds"]) == STEPS
    for step in STEPS:
        assert json.loads((out / f"{step}.json").read_text()) == report[step]
    trainer = report["trainer"]
    assert trainer["resumed_at"] == trainer["steps"] == 3
    assert trainer["snapshot_equals_checkpoint"] > 10  # tensors compared bit for bit
    assert trainer["step_s_snapshot_every_step"] > 0 and trainer["step_s_no_snapshot"] > 0
    assert [row["tp"] for row in report["inplace"]["results"]] == [1, 2]
    assert all(row["inplace_gb_s"] > 0 for row in report["inplace"]["results"])
    for tp in (1, 2):
        full, delta = report[f"freshness-tp{tp}"]["results"]
        assert (full["mode"], delta["mode"]) == ("full", "delta")
        assert full["tp"] == delta["tp"] == tp and full["total"] > 0 and delta["total"] > 0
        (published,) = report[f"publish-tp{tp}"]["results"]
        assert published["publish_s"] > 0


def test_without_out_it_says_what_is_missing() -> None:
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--dry"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "bench/gpu.sh: --out DIR is required (each step's JSON is written there)"
    )
