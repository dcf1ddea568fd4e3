"""The engine nodes' command lines refuse what cannot work, before any work (no vLLM needed).

Refusals that come before any process or thread is started run ``main`` in this process;
``follow --rollout`` installs signal handlers before it refuses, so it runs as a process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcast.cli.main import main

from helpers.processes import run_weightcast


@pytest.fixture
def run_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> Iterator:
    """``main(argv)`` as a new user's shell runs it: (exit status, stderr). The logging set-up
    it does is undone afterwards."""
    for name in [n for n in os.environ if n.startswith("WEIGHTCAST_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    logger = logging.getLogger("weightcast")
    saved = (logger.handlers[:], logger.level, logger.propagate)

    def run(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().err

    yield run
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_up_with_vllm_needs_a_python_that_has_vllm(run_main, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    code, err = run_main("up", "--engine", "vllm", "--vllm-python", str(missing))
    assert code == 2
    assert f"{missing} does not exist" in err and "make vllm-setup" in err
    # This venv has weightcast but no vLLM.
    code, err = run_main("up", "--engine", "vllm", "--vllm-python", sys.executable)
    assert code == 2
    assert "cannot import vllm and weightcast" in err
    assert list((tmp_path / ".weightcast" / "runs").iterdir()) == []  # no run was started


def test_a_rollout_node_on_vllm_needs_vllm(cli_env: dict[str, str]) -> None:
    result = run_weightcast(cli_env, "follow", "--rollout", "--engine", "vllm", timeout=60)
    assert result.returncode == 2
    assert "rollout.engine = vllm needs vLLM" in result.stderr and ".venv-vllm" in result.stderr
    assert "Traceback" not in result.stderr


def test_follow_vllm_url_settings_are_checked(run_main) -> None:
    code, err = run_main("follow", "--vllm-url", "ftp://host:8000")
    assert code == 2
    assert "follow.vllm_url (from --vllm-url) must be empty, or an http://" in err
    code, err = run_main("follow", "--vllm-url", "http://127.0.0.1:8000", "--rollout")
    assert code == 2
    assert "--vllm-url and --rollout exclude each other" in err


def test_follow_drives_one_engine_server(run_main) -> None:
    urls = ["--vllm-url", "http://127.0.0.1:8000", "--sglang-url", "http://127.0.0.1:30000"]
    code, err = run_main("follow", *urls)
    assert code == 2
    assert "--vllm-url and --sglang-url exclude each other" in err
    code, err = run_main("follow", "--sglang-url", "http://127.0.0.1:30000", "--rollout")
    assert code == 2
    assert "--sglang-url and --rollout exclude each other" in err
    code, err = run_main("follow", "--sglang-pause-mode", "pause")
    assert code == 2
    assert "follow.sglang_pause_mode (from --sglang-pause-mode)" in err
