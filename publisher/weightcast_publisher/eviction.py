"""Keep-last-N eviction that never removes a version a reader holds a live lease on.

The lease protocol's eviction script (:meth:`weightcast.contract.leases.Leases.evict`) drops
expired leases, refuses while any lease is live, and otherwise removes the version from
Redis and announces it; only then are its files removed (from the store, and the publisher's
weights directory). A reader that took its lease first keeps every file it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from weightcast.contract.keys import Keys
from weightcast.contract.leases import Leases
from weightcast.contract.version_info import version_dir_name


@dataclass
class EvictionResult:
    evicted: list[int] = field(default_factory=list)
    leased: list[int] = field(default_factory=list)


class Evictor:
    def __init__(
        self, client: redis.Redis, keys: Keys, remove: Callable[[str], None], keep: int
    ) -> None:
        self.client = client
        self.keys = keys
        self.remove = remove
        """Removes a version's files, given its directory name."""
        self.keep = keep
        self.leases = Leases(client, keys)

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
        if not self.leases.evict(version):
            return False
        self.remove(version_dir_name(version))
        return True
