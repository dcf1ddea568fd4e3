"""The CLI's answers to a user's mistakes: short, and saying what to do next."""

from __future__ import annotations

import pytest
import redis

from weightcast.cli.main import COMMANDS, build_parser
from weightcast.contract.keys import Keys
from weightcast.runtime.net import free_port

from helpers.processes import clean_env, run_weightcast


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


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, "--help"])
    assert exited.value.code == 0
    assert "--config FILE" in capsys.readouterr().out


def test_publisher_once_behind_another_leader_is_one_line_and_exit_1(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys
) -> None:
    client.set(keys.publisher_leader, "publisher-elsewhere", px=60_000)
    result = run_weightcast(cli_env, "publisher", "--once", "--leader-ttl-seconds", "0.5")
    assert result.returncode == 1, result.stderr
    assert (
        "weightcast publisher: another publisher (publisher-elsewhere) holds the lock"
        in result.stderr
    )
    assert "Traceback" not in result.stderr and "--once gave up" not in result.stderr
