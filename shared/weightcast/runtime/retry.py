"""Riding out a Redis outage: capped exponential back-off within a time budget.

:class:`Backoff` is the one back-off of every retry loop (Redis, a failing disk, a final
checkpoint).

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

A Redis that refuses this client's credentials or permissions (:func:`access_denied`) is a
mistake, not an outage: it ends at once in
:class:`~weightcast.contract.errors.RedisAccessDenied` (one line, exit status 2).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis

from weightcast.contract.errors import RedisAccessDenied, RedisFull, RedisUnavailable
from weightcast.contract.redis_replies import refusal
from weightcast.runtime.logs import get_logger

log = get_logger("retry")

T = TypeVar("T")

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
"""What a Redis restart looks like to a client: refused or dropped connections, timeouts,
and ``LOADING`` while the restarted server replays its append-only file. (A refused password
is a ``ConnectionError`` too: :func:`access_denied` tells it apart.)"""


def access_denied(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing this client (wrong or missing password, or an ACL
    user without the permission) rather than being away."""
    return refusal(exc) is RedisAccessDenied


def access_error(exc: BaseException, what: str) -> RedisAccessDenied:
    """The one-line error for a Redis that refused this client."""
    return RedisAccessDenied(
        f"Redis refused this client while {what} ({type(exc).__name__}: {exc}); put the "
        "right user and password in common.redis_url (redis://USER:PASSWORD@HOST:PORT/DB) "
        "or grant that user the commands weightcast runs"
    )


def redis_full(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write because it is full (``OOM command not
    allowed when used memory > 'maxmemory'``)."""
    return refusal(exc) is RedisFull


def full_error(exc: BaseException, what: str) -> RedisFull:
    """The one-line error for a write a full Redis refused."""
    return RedisFull(
        f"Redis is full and refuses writes while {what} ({exc}); it reached maxmemory with "
        "the noeviction policy: check that a trainer is consuming (and trimming) the batch "
        "stream, or raise Redis' maxmemory"
    )


class Backoff:
    """Capped exponential pauses: ``first``, twice that, ... at most ``cap`` seconds."""

    def __init__(self, first: float = 0.5, cap: float = 30.0) -> None:
        self.first = first
        self.cap = cap
        self.failures = 0
        """Failures since the last :meth:`reset`."""

    def next(self) -> float:
        """Count a failure; the pause before the next try."""
        self.failures += 1
        return min(self.cap, self.first * 2 ** (self.failures - 1))

    def reset(self) -> None:
        """A try went through: the next failure pauses ``first`` again."""
        self.failures = 0


@dataclass
class Outage:
    """How long Redis may stay away, and since when it has been away (None: it answers)."""

    budget: float = 300.0
    first: float = 0.5
    cap: float = 30.0
    since: float | None = None
    last_error: str = ""
    full: bool = False
    """The current outage is a full Redis refusing writes, not an unreachable one."""

    def __post_init__(self) -> None:
        self.backoff = Backoff(self.first, self.cap)

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    @property
    def attempts(self) -> int:
        """Failed calls in the current outage."""
        return self.backoff.failures

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
        """Record a failed call; the pause before the next try. Raises when out of budget, or
        at once when Redis refused this client (:func:`access_denied`)."""
        if access_denied(exc):
            raise access_error(exc, what) from exc
        now = time.monotonic()
        if self.since is None:
            self.since = now
        pause = self.backoff.next()
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
        pause = min(pause, self.budget - waited)
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
        self.backoff.reset()
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
            if not (isinstance(exc, REDIS_DOWN) or redis_full(exc) or access_denied(exc)):
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
            except redis.RedisError as exc:
                if not (isinstance(exc, REDIS_DOWN) or access_denied(exc)):
                    raise
                sleep(self.failed(exc, what))
                continue
            self.recovered()
            return result
