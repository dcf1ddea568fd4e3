"""A Redis that refuses the client (wrong or missing password, a user without permission) is
a mistake, not an outage: every command and daemon says so in one line and exits 2 at once,
instead of retrying it as "Redis unreachable" for ``redis_retry_seconds``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from weightcast.contract.errors import (
    RedisAccessDenied,
    RedisFull,
    RedisGroupExists,
    WeightcastError,
)
from weightcast.contract.redis_replies import refusal
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.redis_client import redis_client

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


def refusal_of(call: Callable[[], object]) -> type[WeightcastError] | None:
    with pytest.raises(redis.RedisError) as raised:
        call()
    return refusal(raised.value)


def test_a_real_servers_refusals_are_read_into_types(tmp_path: Path) -> None:
    """The replies of this redis-server through redis-py, in plain commands and in scripts:
    each reads as its type (:data:`~weightcast.contract.redis_replies.REPLY_CODES`)."""
    with RedisServer(tmp_path / "redis") as server:
        admin = redis.Redis.from_url(server.url)
        admin.xgroup_create("s", "g", id="0", mkstream=True)
        assert refusal_of(lambda: admin.xgroup_create("s", "g", id="0")) is RedisGroupExists
        assert refusal_of(lambda: admin.xreadgroup("none", "c", {"s": ">"})) is None  # NOGROUP
        assert refusal_of(lambda: admin.xinfo_groups("no-stream")) is None

        admin.acl_setuser(
            "a-only", enabled=True, passwords=["+pw"], keys=["a*"], commands=["+@all"]
        )
        limited = redis_client(f"redis://a-only:pw@127.0.0.1:{server.port}/0")
        set_b = "return redis.call('SET', KEYS[1], 1)"
        assert refusal_of(lambda: limited.set("b", 1)) is RedisAccessDenied
        assert refusal_of(lambda: limited.eval(set_b, 1, "b")) is RedisAccessDenied
        wrong = redis_client(f"redis://a-only:not-it@127.0.0.1:{server.port}/0")
        assert refusal_of(wrong.ping) is RedisAccessDenied

        admin.set("ballast", "x" * 100_000)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        assert refusal_of(lambda: admin.set("k", 1)) is RedisFull
        assert refusal_of(lambda: admin.eval(set_b, 1, "k")) is RedisFull
        admin.config_set("maxmemory", "0")

        admin.config_set("requirepass", PASSWORD)
        assert refusal_of(redis_client(server.url).ping) is RedisAccessDenied
