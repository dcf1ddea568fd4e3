"""The one way a weightcast process connects to Redis.

Every client has bounded timeouts (a Redis that stops answering is an outage, not a hang)
and reconnects once at once (a pooled connection the server closed); retrying beyond that is
:class:`~weightcast.runtime.retry.Outage`'s: its back-off, budget, logs and ``/healthz`` 503.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REPLY_TIMEOUT_S = 10.0
"""How long a connection or a reply may take before the call fails as an outage."""


def redis_client(url: str, timeout: float = REPLY_TIMEOUT_S) -> redis.Redis:
    """A client of ``url`` whose connects and replies fail after ``timeout`` seconds (give a
    blocking read its longest block on top)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), retries=1),
    )
