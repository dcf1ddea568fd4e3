"""Riding out a Redis outage: back-off that doubles up to its cap, within one time budget."""

from __future__ import annotations

import time

import pytest
import redis

from weightcast.contract.errors import RedisAccessDenied, RedisUnavailable
from weightcast.runtime.retry import Outage, Retries


def test_retries_with_doubling_pauses_until_redis_answers() -> None:
    answers = [redis.ConnectionError("refused")] * 3 + [redis.BusyLoadingError("LOADING")] + [7]
    pauses: list[float] = []

    def call() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    outage = Outage(budget=60, first=0.5, cap=2.0)
    assert outage.call(call, "testing", sleep=pauses.append) == 7
    assert pauses == [0.5, 1.0, 2.0, 2.0]
    assert not outage.ongoing and outage.attempts == 0


def test_gives_up_with_a_clear_error_once_the_budget_is_spent() -> None:
    def down() -> None:
        raise redis.ConnectionError("Connection refused")

    outage = Outage(budget=0.0)
    with pytest.raises(RedisUnavailable, match="Redis has not answered for 0s while reading"):
        outage.call(down, "reading", sleep=lambda _: None)
    assert outage.ongoing and "Connection refused" in outage.last_error


def test_other_redis_errors_are_not_retried() -> None:
    def wrong() -> None:
        raise redis.ResponseError("WRONGTYPE")

    with pytest.raises(redis.ResponseError):
        Outage().call(wrong, "reading", sleep=lambda _: pytest.fail("must not wait"))


@pytest.mark.parametrize(
    "refusal",
    [
        redis.AuthenticationError("Authentication required."),
        redis.AuthenticationError("invalid username-password pair or user is disabled."),
        redis.exceptions.NoPermissionError("this user has no permissions to run the 'get' command"),
        redis.ResponseError("NOPERM this user has no permissions (inside a script)"),
    ],
)
def test_a_refused_password_or_permission_is_a_mistake_not_an_outage(
    refusal: redis.RedisError,
) -> None:
    def refused() -> None:
        raise refusal

    outage = Outage(budget=300)
    with pytest.raises(RedisAccessDenied, match="Redis refused this client while reading"):
        outage.call(refused, "reading", sleep=lambda _: pytest.fail("must not wait"))
    with pytest.raises(RedisAccessDenied):
        outage.attempt(refused, "reading", lambda _: pytest.fail("must not wait"))
    assert not outage.ongoing


def test_backoff_doubles_up_to_its_cap_and_starts_over_after_a_success() -> None:
    retries = Retries(first=1.0, cap=5.0)
    assert [retries.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert retries.failures == 5 and not retries.spent  # no budget: retried without end
    retries.reset()
    assert retries.failed() == 1.0


def test_a_pause_never_runs_past_the_budget_counted_from_the_start_given() -> None:
    start = time.monotonic()
    retries = Retries(first=1.0, cap=5.0, budget=0.5, since=start - 0.2)
    pause = retries.failed()
    assert 0.0 < pause <= 0.3 and not retries.spent
    retries.since = start - 1.0
    retries.failed()
    assert retries.spent and retries.waited >= 1.0
