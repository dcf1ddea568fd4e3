"""``weightcast up``: the main job, end to end, and its behaviour when a process fails."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, clean_env, run_weightcast, weightcast

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment mentions ``text`` (a run directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            seen = (
                Path(f"/proc/{pid}/cmdline").read_bytes()
                + Path(f"/proc/{pid}/environ").read_bytes()
            )
        except OSError:
            continue
        if text.encode() in seen and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_up_trains_publishes_and_loads_then_summarises(tmp_path: Path) -> None:
    env = clean_env()
    result = run_weightcast(
        env, "up", "--steps", "6", "--publish-every", "2", "--workdir", str(tmp_path), timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "started a private redis-server at redis://127.0.0.1:" in out
    assert "trained 6 steps" in out
    published = re.search(r"(\d+) versions published, (\d+) evicted, live: (.*)", out)
    assert published, out
    count, evicted, live = int(published[1]), int(published[2]), published[3].split()
    assert count >= 1 and evicted == max(0, count - 2)
    assert live == [f"v{v}" for v in range(max(1, count - 1), count + 1)]
    assert f"the inference node loaded v{count};" in out
    rows = re.findall(r"^  v(\d+)\s+(\d+)\s+([\d.]+)s$", out, re.MULTILINE)
    assert [int(v) for v, _, _ in rows] == list(range(1, count + 1))
    assert int(rows[-1][1]) == 6  # the last version holds the last step
    (run_dir,) = tmp_path.iterdir()
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == live
    assert processes_mentioning(str(run_dir)) == []


def test_up_stops_everything_and_names_the_process_that_failed(tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[trainer.optimizer]\nname = "NoSuchOptimizer"\n')
    env = clean_env()
    result = run_weightcast(
        env,
        "up",
        "--config",
        str(config),
        "--steps",
        "4",
        "--workdir",
        str(tmp_path / "runs"),
        timeout=600,
    )
    assert result.returncode == 1
    assert "weightcast up failed: the trainer exited with code 1" in result.stderr
    assert "Optimizer NoSuchOptimizer not added" in result.stderr  # the log's last lines
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert processes_mentioning(str(run_dir)) == []  # publisher, node, redis all stopped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_every_process(tmp_path: Path, sig: signal.Signals) -> None:
    env = clean_env()
    up = subprocess.Popen(
        weightcast("up", "--steps", "500", "--workdir", str(tmp_path), "--timeout", "120"),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in up.stdout:
        if re.search(r"published v\d+ ", line):  # every process is up, a version went through
            break
    up.send_signal(sig)
    code = up.wait(timeout=60)
    rest = up.stdout.read()
    assert code == 130, rest
    assert "interrupted: stopped every process weightcast up started" in rest
    (run_dir,) = tmp_path.iterdir()
    assert processes_mentioning(str(run_dir)) == []
