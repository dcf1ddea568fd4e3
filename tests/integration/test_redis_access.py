"""A Redis that refuses the client (wrong or missing password, a user without permission) is
a mistake, not an outage: every command and daemon says so in one line and exits 2 at once,
instead of retrying it as "Redis unreachable" for ``redis_retry_seconds``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from weightcast.local.redis_server import RedisServer

from helpers.processes import run_env, run_weightcast

PASSWORD = "s3cret"
LIMITED_USER, LIMITED_PASSWORD = "limited", "limited-pw"

NOAUTH, WRONGPASS, NOPERM = "NOAUTH", "WRONGPASS", "NOPERM"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own with ``requirepass`` and a user allowed nothing."""
    with RedisServer(tmp_path_factory.mktemp("guarded-redis")) as server:
        admin = redis.Redis.from_url(server.url)
        admin.acl_setuser(
            LIMITED_USER, enabled=True, passwords=[f"+{LIMITED_PASSWORD}"], keys=["*"]
        )
        admin.config_set("requirepass", PASSWORD)
        admin.close()
        yield server


def url_for(server: RedisServer, refusal: str) -> str:
    credentials = {
        NOAUTH: "",
        WRONGPASS: ":not-the-password@",
        NOPERM: f"{LIMITED_USER}:{LIMITED_PASSWORD}@",
    }[refusal]
    return f"redis://{credentials}127.0.0.1:{server.port}/0"


def assert_refused_at_once(result: object, started: float, refusal: str) -> None:
    stderr = result.stderr  # type: ignore[attr-defined]
    assert result.returncode == 2, stderr[-3000:]  # type: ignore[attr-defined]
    (line,) = [ln for ln in stderr.splitlines() if "Redis refused this client" in ln]
    assert line.startswith("weightcast ") and ": configuration error: " in line, line
    # redis-py names the refusal by its class (NOAUTH and WRONGPASS: AuthenticationError).
    assert ("NoPermissionError" if refusal == NOPERM else "AuthenticationError") in line, line
    assert "Traceback" not in stderr and "Redis unreachable; retrying" not in stderr
    assert time.monotonic() - started < 90  # not redis_retry_seconds (300 s)


@pytest.mark.parametrize("refusal", [NOAUTH, WRONGPASS, NOPERM])
def test_status_refused_by_redis_is_one_line_and_exit_2(
    guarded: RedisServer, tmp_path: Path, refusal: str
) -> None:
    env = run_env(url_for(guarded, refusal), "access", tmp_path)
    started = time.monotonic()
    assert_refused_at_once(run_weightcast(env, "status", timeout=120), started, refusal)


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (("status", "--watch", "0.5"), NOAUTH),
        (("produce", "--count", "1"), NOAUTH),
        (("follow",), WRONGPASS),
        (("follow",), NOPERM),
        (("publisher",), NOAUTH),
        (("publisher",), NOPERM),
        (("trainer", "--steps", "1"), WRONGPASS),
        (("up", "--steps", "2"), NOPERM),
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(value),
)
def test_every_command_and_daemon_gives_up_at_once_when_redis_refuses_it(
    guarded: RedisServer, tmp_path: Path, args: tuple[str, ...], refusal: str
) -> None:
    url = url_for(guarded, refusal)
    env = run_env(url, "access", tmp_path)
    if args[0] == "up":
        args = (*args, "--redis-url", url, "--workdir", str(tmp_path / "runs"))
    started = time.monotonic()
    assert_refused_at_once(run_weightcast(env, *args, timeout=180), started, refusal)
