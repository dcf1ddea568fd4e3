"""Retrying with capped exponential back-off within a time budget; riding out a Redis outage.

:class:`Retries` is the one back-off of every retry loop: Redis (:class:`Outage`), the object
store (:meth:`~weightcast.store.s3.S3Store.call`), the publisher's failing disk or store and
the trainer's last resume checkpoint. Its pauses are redis-py's
:class:`~redis.backoff.ExponentialBackoff` (``first``, twice that, ... at most ``cap``
seconds), never past the budget, which counts from the first failure in a row (infinite:
retried without end).

Every long-running process (trainer, publisher, ``follow``, ``produce``, ``status --watch``)
keeps working through a Redis restart: a call that fails with a connection error is retried
after 0.5 s, 1 s, 2 s ... (at most ``cap`` seconds apart) until ``budget`` seconds have passed
since the outage began, then :class:`~weightcast.contract.errors.RedisUnavailable` says so.
:class:`Outage` remembers when the current outage began, so ``/healthz`` can report 503 while
it lasts and the budget spans every call made during it.

A full Redis (``maxmemory`` reached with the ``noeviction`` policy) answers, but refuses
writes with an ``OOM`` error (:func:`redis_full`). Whoever can wait for room
(:meth:`Outage.attempt`) treats it as an outage too (it ends when the trainer trims the stream
or an operator frees memory); the budget then ends in
:class:`~weightcast.contract.errors.RedisFull`. :meth:`Outage.call` raises it.

A Redis that refuses this client's credentials or permissions (:func:`access_denied`) is a
mistake, not an outage: it ends at once in
:class:`~weightcast.contract.errors.RedisAccessDenied` (one line, exit status 2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff

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


@dataclass
class Retries:
    """Failures in a row, paced by capped exponential back-off within a time budget.

    ``budget`` seconds count from ``since``: the first failure, unless given (a call whose
    budget includes its first try).
    """

    first: float = 0.5
    cap: float = 30.0
    budget: float = math.inf
    since: float | None = None
    """When the failures in a row began (``time.monotonic()``); None: none yet."""
    failures: int = 0
    """Failures since the last :meth:`reset`."""
    waited: float = 0.0
    """Seconds from ``since`` to the last failure."""

    def __post_init__(self) -> None:
        self._backoff = ExponentialBackoff(cap=self.cap, base=self.first)

    @property
    def spent(self) -> bool:
        """Whether the last failure came once the budget was spent: give up."""
        return self.waited >= self.budget

    def failed(self) -> float:
        """Count a failure; the pause before the next try, cut to what is left of the budget
        (check :attr:`spent` first)."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        self.failures += 1
        self.waited = now - self.since
        return min(self._backoff.compute(self.failures - 1), self.budget - self.waited)

    def reset(self) -> None:
        """A try went through: the next failure pauses ``first`` again, with a whole budget."""
        self.since = None
        self.failures = 0
        self.waited = 0.0


@dataclass
class Outage:
    """How long Redis may stay away, and since when it has been away (None: it answers)."""

    budget: float = 300.0
    first: float = 0.5
    cap: float = 30.0
    last_error: str = ""
    full: bool = False
    """The current outage is a full Redis refusing writes, not an unreachable one."""
    retries: Retries = field(init=False)

    def __post_init__(self) -> None:
        self.retries = Retries(self.first, self.cap, self.budget)

    @property
    def since(self) -> float | None:
        return self.retries.since

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    @property
    def attempts(self) -> int:
        """Failed calls in the current outage."""
        return self.retries.failures

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
        pause = self.retries.failed()
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.full = redis_full(exc)
        waited = self.retries.waited
        if self.retries.spent and self.full:
            raise full_error(exc, f"{what}, for {waited:.0f}s") from exc
        if self.retries.spent:
            raise RedisUnavailable(
                f"Redis has not answered for {waited:.0f}s while {what} ({self.last_error}); "
                "check that redis-server is running and reachable, then restart this process"
            ) from exc
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
        self.retries.reset()
        self.last_error = ""
        self.full = False

    def attempt(self, fn: Callable[[], object], what: str, wait: Callable[[float], object]) -> bool:
        """Run ``fn`` once: True when it went through. When Redis is unreachable or full the
        failure is recorded, ``wait`` is handed the pause before the next try and False is
        returned; raises once the budget is spent. For loops that must keep control between
        tries (a stop request, a node's other duties)."""
        return self._once(fn, what, wait, full=True)

    def call(
        self, fn: Callable[[], T], what: str, sleep: Callable[[float], object] = time.sleep
    ) -> T:
        """``fn()``, retried through an outage; ``what`` says what was being done. Unlike
        :meth:`attempt` it raises a full Redis's refusal: its callers cannot wait for room."""
        results: list[T] = []
        while not self._once(lambda: results.append(fn()), what, sleep, full=False):
            pass
        return results[0]

    def _once(
        self, fn: Callable[[], object], what: str, wait: Callable[[float], object], full: bool
    ) -> bool:
        """Run ``fn`` once: True when it went through, False once an outage's failure (a full
        Redis's too when ``full``) is recorded and ``wait`` handed its pause."""
        try:
            fn()
        except REDIS_DOWN as exc:  # a refused password too: failed() raises it at once
            wait(self.failed(exc, what))
            return False
        except redis.ResponseError as exc:  # typed (OOM, NOPERM) or a script's, by its code
            if not (access_denied(exc) or (full and redis_full(exc))):
                raise
            wait(self.failed(exc, what))
            return False
        self.recovered()
        return True
