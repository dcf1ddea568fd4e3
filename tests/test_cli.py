"""The CLI's answers to a user's mistakes: short, and saying what to do next."""

from __future__ import annotations

import os

from shared.redis_server import free_port

from helpers import run_weightcast


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCAST_")}


def test_unreachable_redis_is_reported_with_what_to_do() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run_weightcast(clean_env(), "status", "--redis-url", url, timeout=60)
    assert result.returncode == 1
    assert f"cannot reach Redis at {url}" in result.stderr
    assert "Start redis-server or pass --redis-url" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_settings_are_a_configuration_error() -> None:
    env = {**clean_env(), "WEIGHTCAST_PUBLISHER_TP": "two"}
    result = run_weightcast(env, "publisher", timeout=60)
    assert result.returncode == 2
    assert "configuration error: $WEIGHTCAST_PUBLISHER_TP" in result.stderr
