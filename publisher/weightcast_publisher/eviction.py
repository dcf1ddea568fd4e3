"""Keep-last-N eviction that never removes a version a reader holds a live lease on.

One Lua script drops expired leases, refuses while any lease is live, and otherwise removes
the version from Redis and announces it; only then is the directory renamed out of the
namespace and deleted. A reader that took its lease first keeps every file it needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import redis

from weightcast.contract.durable import remove_dir
from weightcast.contract.keys import Keys
from weightcast_publisher.converter import version_dir_name

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


@dataclass
class EvictionResult:
    evicted: list[int] = field(default_factory=list)
    leased: list[int] = field(default_factory=list)


class Evictor:
    def __init__(self, client: redis.Redis, keys: Keys, weights_dir: Path, keep: int) -> None:
        self.client = client
        self.keys = keys
        self.weights_dir = weights_dir
        self.keep = keep
        self._evict = client.register_script(_EVICT)

    def run(self) -> EvictionResult:
        """Evict every live version older than the newest ``keep`` that no one leases."""
        live = [int(v) for v in self.client.zrange(self.keys.versions, 0, -1)]
        result = EvictionResult()
        for version in live[: max(0, len(live) - self.keep)]:
            if self.evict(version):
                result.evicted.append(version)
            else:
                result.leased.append(version)
        return result

    def evict(self, version: int) -> bool:
        message = json.dumps({"event": "evicted", "version": version})
        keys = [self.keys.versions, self.keys.version(version), self.keys.leases(version)]
        if not self._evict(keys=keys, args=[version, self.keys.events, message]):
            return False
        remove_dir(self.weights_dir / version_dir_name(version))
        return True
