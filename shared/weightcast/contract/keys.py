"""Redis key names for one namespace.

Every key carries the hash tag ``{namespace}`` so that the multi-key scripts (registration,
eviction, leases) touch a single slot and also run on Redis Cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRAINER_GROUP = "trainer"
"""Consumer group of the batch stream that trainers read with XREADGROUP."""

SNAPSHOT_SKIPPED = "skipped"
"""Value in :attr:`Keys.snapshots` for a snapshot passed over because a newer one was pending."""
SNAPSHOT_QUARANTINED = "quarantined"
"""Value in :attr:`Keys.snapshots` for a snapshot that could not be read or converted."""

NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
"""What a namespace may be: it becomes the Redis hash tag ``{namespace}`` of every key."""
_NAMESPACE = re.compile(NAMESPACE_PATTERN)


@dataclass(frozen=True)
class Keys:
    """The key names of one weightcast deployment (``wc`` unless told otherwise)."""

    namespace: str = "wc"

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} must be 1-64 characters of letters, digits, "
                "'_', '.' or '-' (it becomes the Redis hash tag)"
            )

    @property
    def tag(self) -> str:
        return "{" + self.namespace + "}"

    @property
    def batches(self) -> str:
        """Stream of rollout batches (consumer group ``trainer``)."""
        return f"{self.tag}:batches"

    @property
    def dead_letters(self) -> str:
        """Stream of rejected batches: original fields plus ``reason`` and ``orig_id``."""
        return f"{self.tag}:batches:dead"

    @property
    def latest(self) -> str:
        """Newest published version number; only ever increases."""
        return f"{self.tag}:weights:latest"

    @property
    def versions(self) -> str:
        """Sorted set of live versions (member and score are the version number)."""
        return f"{self.tag}:weights:versions"

    @property
    def deltas(self) -> str:
        """Sorted set of delta-only versions (member and score are the version number): no
        longer live, their full files removed, their registry entry (:meth:`version`),
        ``manifest.json``, ``config.json`` and delta file kept, links of a node's delta chain.
        A version is in :attr:`versions` or here, never in both; ``latest`` and
        :attr:`versions` mean what they meant before deltas outlived their versions."""
        return f"{self.tag}:weights:deltas"

    @property
    def next_version(self) -> str:
        """Counter that hands out version numbers with INCR."""
        return f"{self.tag}:weights:next"

    @property
    def events(self) -> str:
        """Pub/sub channel of the :mod:`~weightcast.contract.events` (``published``,
        ``evicted``), as JSON."""
        return f"{self.tag}:weights:events"

    @property
    def snapshots(self) -> str:
        """Hash snapshot id -> version number, ``skipped`` or ``quarantined``: handled once."""
        return f"{self.tag}:weights:snapshots"

    @property
    def snapshot_order(self) -> str:
        """Sorted set snapshot id -> unix time its :attr:`snapshots` record was first seen:
        the order in which those records are pruned."""
        return f"{self.tag}:weights:snapshots:order"

    @property
    def quarantine(self) -> str:
        """Hash snapshot id (or directory name) -> a
        :class:`~weightcast.contract.quarantine.QuarantineRecord` as JSON."""
        return f"{self.tag}:weights:quarantine"

    @property
    def publisher_leader(self) -> str:
        """String holding the active publisher's id, with a TTL it renews (``SET NX PX``)."""
        return f"{self.tag}:publisher:leader"

    @property
    def nodes(self) -> str:
        """Hash node id -> a :class:`~weightcast.contract.nodes.NodeReport` as JSON."""
        return f"{self.tag}:nodes"

    @property
    def trainer_heartbeat(self) -> str:
        """Hash the trainer refreshes every step: a
        :class:`~weightcast.contract.heartbeat.Heartbeat`."""
        return f"{self.tag}:trainer:heartbeat"

    @property
    def trainer_attempts(self) -> str:
        """Hash stream entry id -> failed attempts: steps that trained it and never finished
        (the trainer died or raised). Cleared when the entry is acknowledged or dead-lettered."""
        return f"{self.tag}:trainer:attempts"

    @property
    def trainer_running(self) -> str:
        """Hash consumer -> comma-separated entry ids of the step it is running now."""
        return f"{self.tag}:trainer:running"

    def version(self, number: int) -> str:
        """Hash describing version ``number``: a
        :class:`~weightcast.contract.version_info.VersionInfo`."""
        return f"{self.tag}:weights:v:{number}"

    def leases(self, number: int) -> str:
        """Sorted set of readers holding version ``number``: node id -> expiry (ms)."""
        return f"{self.tag}:weights:leases:{number}"
