"""One error tree: what weightcast raises across modules is a ``WeightcastError``; what a
library gives only as text (Redis' error replies, vLLM's refusal) is read once into a type."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import redis

from weightcast.client.engine import REFUSED, EngineError, VersionRefused
from weightcast.client.vllm.engine import engine_error
from weightcast.contract.errors import (
    RedisAccessDenied,
    RedisFull,
    RedisGroupExists,
    WeightcastError,
)
from weightcast.contract.redis_replies import REPLY_CODES, refusal
from weightcast.runtime.retry import access_denied, redis_full

PACKAGES = ("weightcast", "weightcast_trainer", "weightcast_publisher")


def exception_classes() -> list[type[BaseException]]:
    """Every exception class the three packages define (the vLLM backend only where vLLM is
    installed: it runs inside vLLM's workers)."""
    found = []
    for root in PACKAGES:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] == "vllm":
                    continue
                raise
            found += [
                value
                for value in vars(module).values()
                if inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ]
    return found


def test_every_error_weightcast_defines_is_a_weightcast_error() -> None:
    classes = exception_classes()
    assert len(classes) > 20  # the walk found the tree
    assert [c.__qualname__ for c in classes if not issubclass(c, WeightcastError)] == []


def test_a_refused_version_is_told_from_an_engine_failure_by_its_type() -> None:
    refused = engine_error(f"POST /update_weights: HTTP 500: version 3 {REFUSED}: bad shape")
    failed = engine_error("POST /update_weights: HTTP 500: CUDA out of memory")
    assert isinstance(refused, VersionRefused)
    assert type(failed) is EngineError


@pytest.mark.parametrize(
    ("exc", "meaning"),
    [
        # What redis-py types itself (it drops the code from the text).
        (redis.AuthenticationError("invalid username-password pair"), RedisAccessDenied),
        (redis.exceptions.NoPermissionError("no permissions to run the 'xadd'"), RedisAccessDenied),
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory"), RedisFull),
        # What it leaves as text, the code first.
        (redis.ResponseError("NOPERM this user has no permissions"), RedisAccessDenied),
        (redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), RedisFull),
        (redis.ResponseError("BUSYGROUP Consumer Group name already exists"), RedisGroupExists),
        # No refusal of ours: let through (or an outage, decided elsewhere).
        (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), None),
        (redis.ResponseError("ERR no such key, not BUSYGROUP"), None),
        (redis.ResponseError(""), None),
        (redis.ConnectionError("Connection refused"), None),
        (ValueError("NOPERM"), None),
    ],
)
def test_redis_replies_are_read_once_into_types(
    exc: BaseException, meaning: type[WeightcastError] | None
) -> None:
    assert refusal(exc) is meaning
    assert access_denied(exc) == (meaning is RedisAccessDenied)
    assert redis_full(exc) == (meaning is RedisFull)


@pytest.mark.parametrize("code", sorted(REPLY_CODES))
def test_every_code_in_the_table_is_read_from_a_bare_reply(code: str) -> None:
    assert refusal(redis.ResponseError(f"{code} some text")) is REPLY_CODES[code]
