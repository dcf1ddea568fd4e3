"""Keep-last-N eviction that never removes a version a reader holds a live lease on, and the
delta window: an evicted version's delta outlives its full files.

The lease protocol's scripts (:mod:`weightcast.contract.leases`) drop expired leases, refuse
while any lease is live, and otherwise change the registry and announce it; only then are the
files touched. A reader that took its lease first keeps every file it needs.

Of the versions older than the newest ``keep``, those whose delta can still be a link of a
node's chain to the newest version (it is on the chain of ``delta_from`` from the newest one,
no version without a delta in between) stay as **delta-only** versions while they are among
the newest ``delta_window`` such (:meth:`Leases.trim`: out of ``versions``, into ``deltas``,
its files trimmed to :func:`delta_only_names` in the store: the publisher's
:meth:`~weightcast.store.base.WritableStore.trim_version`); every other one is evicted whole
(:meth:`~weightcast.store.base.WritableStore.remove_version`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from weightcast.contract.delta import CODECS, delta_file_name
from weightcast.contract.keys import Keys
from weightcast.contract.leases import Leases
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.contract.snapshot_format import CONFIG_NAME


@dataclass
class EvictionResult:
    evicted: list[int] = field(default_factory=list)
    leased: list[int] = field(default_factory=list)
    trimmed: list[int] = field(default_factory=list)
    """Versions made delta-only: their full files removed, their delta kept."""


class Evictor:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        remove: Callable[[int], None],
        trim: Callable[[int, int], None],
        keep: int,
        delta_window: int = 0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.remove = remove
        """Removes every file of a version (here, and in the store)."""
        self.trim_files = trim
        """Trims a version's files to a delta-only version's, given its ``delta_from``."""
        self.keep = keep
        self.delta_window = delta_window
        self.leases = Leases(client, keys)

    def run(self) -> EvictionResult:
        """Evict or trim every live version older than the newest ``keep`` that no one
        leases, and evict the delta-only versions past the window (unless leased)."""
        live = [int(v) for v in self.client.zrange(self.keys.versions, 0, -1)]
        deltas = self.delta_versions()
        kept = self.delta_only_kept(live, deltas)
        result = EvictionResult()
        for version in live[: max(0, len(live) - self.keep)]:
            if version in kept:
                done = self.trim(version)
                if done:
                    result.trimmed.append(version)
                elif done is False:
                    result.leased.append(version)
            elif self.evict(version):
                result.evicted.append(version)
            else:
                result.leased.append(version)
        for version in deltas:
            if version in kept:
                continue
            if self.evict(version):
                result.evicted.append(version)
            else:
                result.leased.append(version)
        return result

    def delta_versions(self) -> list[int]:
        """The delta-only versions, oldest first."""
        return [int(v) for v in self.client.zrange(self.keys.deltas, 0, -1)]

    def delta_only_kept(self, live: list[int], deltas: list[int]) -> set[int]:
        """The versions (live now or delta-only) to keep delta-only: on the chain of
        ``delta_from`` down from the newest live version, below the newest ``keep``, the
        newest ``delta_window`` of them."""
        if not self.delta_window or not live:
            return set()
        registered = set(live) | set(deltas)
        pipe = self.client.pipeline(transaction=False)
        order = sorted(registered)
        for version in order:
            pipe.hget(self.keys.version(version), "delta_from")
        delta_from = {v: int(d or 0) for v, d in zip(order, pipe.execute(), strict=True)}
        full = set(live[-self.keep :])
        chain, at = [], live[-1]
        while at in registered and delta_from[at] > 0:
            if at not in full:
                chain.append(at)
            at = delta_from[at]
        return set(chain[: self.delta_window])

    def evict(self, version: int) -> bool:
        if not self.leases.evict(version):
            return False
        self.remove(version)
        return True

    def trim(self, version: int) -> bool | None:
        """Make ``version`` delta-only (True), or not while leased (False), or None when it
        is no longer live."""
        done = self.leases.trim(version)
        if done:
            delta_from = int(self.client.hget(self.keys.version(version), "delta_from") or 0)
            self.trim_files(version, delta_from)
        return done


def delta_only_names(delta_from: int) -> set[str]:
    """The files a delta-only version keeps: what a node reads of a chain's link (the
    manifest and the delta, in any codec a node reads: an older publisher's too) and the
    config the manifest lists."""
    return {MANIFEST_NAME, CONFIG_NAME, *(delta_file_name(delta_from, c) for c in CODECS)}
