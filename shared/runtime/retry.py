"""Riding out a Redis outage: capped exponential back-off within a time budget.

Every long-running process (trainer, publisher, ``follow``, ``produce``, ``status --watch``)
keeps working through a Redis restart: a call that fails with a connection error is retried
after 0.5 s, 1 s, 2 s ... (at most ``cap`` seconds apart) until ``budget`` seconds have passed
since the outage began, then :class:`~weightcast.contract.errors.RedisUnavailable` says so.
:class:`Outage` remembers when the current outage began, so ``/healthz`` can report 503 while
it lasts and the budget spans every call made during it.

A full Redis (``maxmemory`` reached with the ``noeviction`` policy) answers, but refuses
writes with an ``OOM`` error (:func:`redis_full`). Whoever can wait for room treats it as an
outage too (it ends when the trainer trims the stream or an operator frees memory); the
budget then ends in :class:`~weightcast.contract.errors.RedisFull`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis

from weightcast.contract.errors import RedisFull, RedisUnavailable
from weightcast.runtime.logs import get_logger

log = get_logger("retry")

T = TypeVar("T")

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
"""What a Redis restart looks like to a client: refused or dropped connections, timeouts,
and ``LOADING`` while the restarted server replays its append-only file."""


def redis_full(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because it is full (``OOM command not
    allowed when used memory > 'maxmemory'``)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return True
    # Inside a Lua script (a lease) the refusal comes back as the script's error text.
    return isinstance(exc, redis.ResponseError) and "OOM command not allowed" in str(exc)


def full_error(exc: BaseException, what: str) -> RedisFull:
    """The one-line error for a write a full Redis refused."""
    return RedisFull(
        f"Redis is full and refuses writes while {what} ({exc}); it reached maxmemory with "
        "the noeviction policy: check that a trainer is consuming (and trimming) the batch "
        "stream, or raise Redis' maxmemory"
    )


@dataclass
class Outage:
    """How long Redis may stay away, and since when it has been away (None: it answers)."""

    budget: float = 300.0
    first: float = 0.5
    cap: float = 30.0
    since: float | None = None
    attempts: int = 0
    last_error: str = ""
    full: bool = False
    """The current outage is a full Redis refusing writes, not an unreachable one."""

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def detail(self) -> dict[str, object]:
        """Redis' state for ``/healthz``: ``ok``, or how it fails and for how long."""
        if self.since is None:
            return {"redis": "ok"}
        return {
            "redis": "full" if self.full else "unreachable",
            "for_s": round(time.monotonic() - self.since, 1),
            "error": self.last_error,
        }

    def failed(self, exc: BaseException, what: str) -> float:
        """Record a failed call; the pause before the next try. Raises when out of budget."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        self.attempts += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.full = redis_full(exc)
        waited = now - self.since
        if waited >= self.budget and self.full:
            raise full_error(exc, f"{what}, for {waited:.0f}s") from exc
        if waited >= self.budget:
            raise RedisUnavailable(
                f"Redis has not answered for {waited:.0f}s while {what} ({self.last_error}); "
                "check that redis-server is running and reachable, then restart this process"
            ) from exc
        pause = min(self.cap, self.first * 2 ** (self.attempts - 1), self.budget - waited)
        log.warning(
            "Redis is full; retrying" if self.full else "Redis unreachable; retrying",
            what=what,
            error=self.last_error,
            retry_in=round(pause, 2),
            down_for=round(waited, 1),
        )
        return pause

    def recovered(self) -> None:
        """A call went through: the outage, if any, is over."""
        if self.since is not None:
            log.info("Redis is back", down_for=round(time.monotonic() - self.since, 1))
        self.since = None
        self.attempts = 0
        self.last_error = ""
        self.full = False

    def attempt(self, fn: Callable[[], object], what: str, wait: Callable[[float], object]) -> bool:
        """Run ``fn`` once: True when it went through. When Redis is unreachable or full the
        failure is recorded, ``wait`` is handed the pause before the next try and False is
        returned; raises once the budget is spent. For loops that must keep control between
        tries (a stop request, a node's other duties)."""
        try:
            fn()
        except Exception as exc:
            if not (isinstance(exc, REDIS_DOWN) or redis_full(exc)):
                raise
            wait(self.failed(exc, what))
            return False
        self.recovered()
        return True

    def call(
        self, fn: Callable[[], T], what: str, sleep: Callable[[float], object] = time.sleep
    ) -> T:
        """``fn()``, retried through an outage; ``what`` says what was being done."""
        while True:
            try:
                result = fn()
            except REDIS_DOWN as exc:
                sleep(self.failed(exc, what))
                continue
            self.recovered()
            return result
