"""The vLLM node's command lines refuse what cannot work, before any work (no vLLM needed)."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import clean_env, run_weightcast


def test_up_with_vllm_needs_a_python_that_has_vllm(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    result = run_weightcast(
        clean_env(), "up", "--engine", "vllm", "--vllm-python", str(missing), timeout=60
    )
    assert result.returncode == 2
    assert f"{missing} does not exist" in result.stderr and "make vllm-setup" in result.stderr
    # This venv has weightcast but no vLLM.
    result = run_weightcast(
        clean_env(), "up", "--engine", "vllm", "--vllm-python", sys.executable, timeout=60
    )
    assert result.returncode == 2
    assert "cannot import vllm and weightcast" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_rollout_node_on_vllm_needs_vllm(cli_env: dict[str, str]) -> None:
    result = run_weightcast(cli_env, "follow", "--rollout", "--engine", "vllm", timeout=60)
    assert result.returncode == 2
    assert "rollout.engine = vllm needs vLLM" in result.stderr and ".venv-vllm" in result.stderr


def test_follow_vllm_url_settings_are_checked(cli_env: dict[str, str]) -> None:
    result = run_weightcast(cli_env, "follow", "--vllm-url", "ftp://host:8000", timeout=60)
    assert result.returncode == 2
    assert "follow.vllm_url (from --vllm-url) must be empty, or an http://" in result.stderr
    url = "http://127.0.0.1:8000"
    result = run_weightcast(cli_env, "follow", "--vllm-url", url, "--rollout", timeout=60)
    assert result.returncode == 2
    assert "--vllm-url and --rollout exclude each other" in result.stderr
