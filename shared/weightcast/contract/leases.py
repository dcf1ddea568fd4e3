"""Leases, eviction and trimming: one protocol, so its scripts live here, side by side.

A reader holds version N by a member of ``{wc}:weights:leases:<N>`` (its reader id) scored
with its expiry in Redis's own clock (``TIME``, ms). :meth:`Leases.take` adds or renews it
only while N is live and returns N's registry entry in the same script, so a reader either
holds a version that stays on disk or learns at once that it is gone. :meth:`Leases.evict`
drops expired leases and removes N from the live set only while no lease is live. Both run
in Redis, one at a time, so an eviction and a lease never interleave: the one that runs
second sees the other's effect.

Delta chains add a second life to a version: :meth:`Leases.trim` turns a live version into
a delta-only one (out of ``versions``, into ``deltas``, its entry kept: its full files go,
its manifest and delta stay), :meth:`Leases.take_link` leases a version that is live or
delta-only (a link of a chain, whose delta only is read), and :meth:`Leases.evict` removes
either kind. Trimming and evicting obey the one rule: never while a lease is live.
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

_LEASE_LINK = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and not redis.call('ZSCORE', KEYS[2], ARGV[1])
then return false end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[3], now_ms + tonumber(ARGV[3]), ARGV[2])
return redis.call('HGETALL', KEYS[4])
"""
"""KEYS: versions, deltas, leases:<N>, v:<N>. ARGV: N, reader id, lease ms. The entry of a
live or delta-only version, or nil."""

_EVICT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
if redis.call('ZCARD', KEYS[3]) > 0 then return 0 end
local live = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[2])
if live == 1 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
return 1
"""
"""KEYS: versions, v:<N>, leases:<N>, deltas. ARGV: N, the events channel, the evicted
event. 1 when evicted (live or delta-only), 0 while a lease is live. ``evicted`` is
published when N stops being live: here for a live version, by the trim script for a version
made delta-only (not again when it is evicted from ``deltas``)."""

_TRIM = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return -1 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
if redis.call('ZCARD', KEYS[3]) > 0 then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""
"""KEYS: versions, deltas, leases:<N>. ARGV: N, the events channel, the evicted event.
1 when N became delta-only, 0 while a lease is live, -1 when N is not live."""


class Leases:
    """The lease protocol of one namespace: nodes take, renew and release leases, the
    publisher evicts."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self._lease = client.register_script(_LEASE)
        self._evict = client.register_script(_EVICT)
        self._lease_link = client.register_script(_LEASE_LINK)
        self._trim = client.register_script(_TRIM)

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

    def take_link(self, version: int, reader: str, lease_ms: int) -> VersionInfo:
        """:meth:`take` for a link of a delta chain: ``version`` may be live or delta-only
        (only its manifest and delta are read). :class:`VersionGone` when it is neither."""
        keys = self.keys
        reply = self._lease_link(
            keys=[keys.versions, keys.deltas, keys.leases(version), keys.version(version)],
            args=[version, reader, lease_ms],
        )
        if not reply:
            raise VersionGone(f"version {version} is neither live nor delta-only")
        return VersionInfo.from_fields(version, dict(zip(reply[::2], reply[1::2], strict=True)))

    def release(self, version: int, reader: str) -> None:
        """Remove ``reader``'s lease (one that is not removed expires by itself)."""
        self.client.zrem(self.keys.leases(version), reader)

    def evict(self, version: int) -> bool:
        """Remove ``version`` (live or delta-only) from the registry and announce it, unless
        a reader holds a live lease on it; whether it was removed. Its directory is the
        caller's to remove, after this returned True."""
        keys = self.keys
        return bool(
            self._evict(
                keys=[keys.versions, keys.version(version), keys.leases(version), keys.deltas],
                args=[version, keys.events, Evicted(version).encode()],
            )
        )

    def trim(self, version: int) -> bool | None:
        """Make live ``version`` delta-only (out of ``versions``, into ``deltas``, its entry
        kept; announced as evicted: it is no longer live), unless a reader holds a live lease
        on it: True when done, False while leased, None when it is not live. Its directory is
        the caller's to trim to the manifest, config and delta, after this returned True."""
        keys = self.keys
        done = int(
            self._trim(
                keys=[keys.versions, keys.deltas, keys.leases(version)],
                args=[version, keys.events, Evicted(version).encode()],
            )
        )
        return None if done < 0 else bool(done)
