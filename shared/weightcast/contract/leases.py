"""Leases and eviction: one protocol, so both of its scripts live here, side by side.

A reader holds version N by a member of ``{wc}:weights:leases:<N>`` (its reader id) scored
with its expiry in Redis's own clock (``TIME``, ms). :meth:`Leases.take` adds or renews it
only while N is live and returns N's registry entry in the same script, so a reader either
holds a version that stays on disk or learns at once that it is gone. :meth:`Leases.evict`
drops expired leases and removes N from the live set only while no lease is live. Both run
in Redis, one at a time, so an eviction and a lease never interleave: the one that runs
second sees the other's effect.
"""

from __future__ import annotations

import redis

from weightcast.contract.errors import VersionGone
from weightcast.contract.events import Evicted
from weightcast.contract.keys import Keys
from weightcast.contract.version_info import VersionInfo

_LEASE = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return false end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[2])
return redis.call('HGETALL', KEYS[3])
"""
"""KEYS: versions, leases:<N>, v:<N>. ARGV: N, reader id, lease ms. The entry, or nil."""

_EVICT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
if redis.call('ZCARD', KEYS[3]) > 0 then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""
"""KEYS: versions, v:<N>, leases:<N>. ARGV: N, the events channel, the evicted event.
1 when evicted, 0 while a lease is live."""


class Leases:
    """The lease protocol of one namespace: nodes take, renew and release leases, the
    publisher evicts."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self._lease = client.register_script(_LEASE)
        self._evict = client.register_script(_EVICT)

    def take(self, version: int, reader: str, lease_ms: int) -> VersionInfo:
        """Add or renew ``reader``'s lease on ``version`` for ``lease_ms``; the version's
        registry entry. :class:`VersionGone` when it is no longer live."""
        keys = self.keys
        reply = self._lease(
            keys=[keys.versions, keys.leases(version), keys.version(version)],
            args=[version, reader, lease_ms],
        )
        if not reply:
            raise VersionGone(f"version {version} is no longer live")
        return VersionInfo.from_fields(version, dict(zip(reply[::2], reply[1::2], strict=True)))

    def release(self, version: int, reader: str) -> None:
        """Remove ``reader``'s lease (one that is not removed expires by itself)."""
        self.client.zrem(self.keys.leases(version), reader)

    def evict(self, version: int) -> bool:
        """Remove ``version`` from the registry and announce it, unless a reader holds a
        live lease on it; whether it was removed. Its directory is the caller's to remove,
        after this returned True."""
        keys = self.keys
        return bool(
            self._evict(
                keys=[keys.versions, keys.version(version), keys.leases(version)],
                args=[version, keys.events, Evicted(version).encode()],
            )
        )
