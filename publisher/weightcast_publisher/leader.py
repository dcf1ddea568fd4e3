"""One active publisher per namespace: a lease-style lock in Redis, renewed while alive.

``{wc}:publisher:leader`` holds the leader's id with a TTL (``SET NX PX``). The leader
renews it every third of the TTL; a standby retries until the key expires, so it takes over
within one TTL after the leader dies. The lock is a liveness tool, not the safety net:
registration itself checks the holder inside its Lua script, so an ex-leader that was paused
past its TTL cannot register a version.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid

import redis

from weightcast.contract.keys import Keys
from weightcast.runtime.logs import get_logger

log = get_logger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def holder_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class LeaderLock:
    """Take, keep and release the publisher lock of one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_seconds: float) -> None:
        self.client = client
        self.key = keys.publisher_leader
        self.holder = holder_id()
        self.ttl_ms = int(ttl_seconds * 1000)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._held_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """True while the last successful renewal is younger than the TTL."""
        return time.monotonic() < self._held_until

    def try_acquire(self) -> bool:
        """Take or renew the lock now; False when another publisher holds it."""
        start = time.monotonic()
        if self._renew(keys=[self.key], args=[self.holder, self.ttl_ms]):
            self._held_until = start + self.ttl_ms / 1000
            return True
        self._held_until = 0.0
        return False

    def current_holder(self) -> str | None:
        value = self.client.get(self.key)
        return value.decode() if value else None

    def start_renewing(self) -> None:
        """Renew in the background every third of the TTL until :meth:`release`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._renew_loop, name="weightcast-leader", daemon=True
            )
            self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._held_until:
            with contextlib.suppress(redis.RedisError):  # the TTL frees it anyway
                self._release(keys=[self.key], args=[self.holder])
        self._held_until = 0.0

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            was_held = self.held
            try:
                if not self.try_acquire() and was_held:
                    log.warning("lost the publisher lock", holder=self.current_holder())
            except redis.RedisError as exc:
                if not self.held and was_held:
                    log.warning("publisher lock expired while Redis was unreachable", error=exc)
