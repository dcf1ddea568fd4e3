"""Version numbers and registration in Redis, each one atomic.

Registration is one Lua script: it refuses when the caller no longer holds the publisher
lock or when the snapshot was already handled, then writes the version hash, adds it to the
sorted set, raises ``latest`` (never lowers it), records the snapshot as published and
publishes the event. Readers see all of it or none of it.
"""

from __future__ import annotations

import redis

from weightcast.contract.events import Published
from weightcast.contract.keys import Keys
from weightcast.contract.quarantine import QuarantineRecord
from weightcast.contract.version_info import VersionInfo

NOT_LEADER = -1
ALREADY_HANDLED = 0
REGISTERED = 1

_REGISTER = """
local handled = redis.call('HGET', KEYS[4], ARGV[2])
if handled == ARGV[1] then return 1 end
if redis.call('GET', KEYS[5]) ~= ARGV[5] then return -1 end
if handled then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[1]) > latest then redis.call('SET', KEYS[3], ARGV[1]) end
redis.call('HSET', KEYS[4], ARGV[2], ARGV[1])
redis.call('PUBLISH', ARGV[4], ARGV[3])
return 1
"""


class Registry:
    """The publisher's writes to the version keys of one namespace."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._register = client.register_script(_REGISTER)

    def allocate_version(self) -> int:
        """A fresh version number: unique and increasing across restarts."""
        return int(self.client.incr(self.keys.next_version))

    def handled(self) -> dict[str, str]:
        """Snapshot id -> version number, ``skipped`` or ``quarantined``."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.snapshots).items()}

    def mark(self, snapshot_id: str, outcome: str) -> None:
        """Record a snapshot that will not be published (skipped or quarantined)."""
        self.client.hsetnx(self.keys.snapshots, snapshot_id, outcome)

    def record_quarantine(self, name: str, record: QuarantineRecord) -> None:
        """Keep why a snapshot was quarantined where ``weightcast status`` and people can see."""
        self.client.hset(self.keys.quarantine, name, record.encode())

    def register(self, info: VersionInfo, event: Published, holder: str) -> int:
        """Register ``info`` (its snapshot ``info.snapshot_id``) atomically while ``holder``
        holds the publisher lock, announcing ``event``.

        Returns :data:`REGISTERED` (also when this very version was registered by an earlier
        call whose reply was lost), :data:`ALREADY_HANDLED` or :data:`NOT_LEADER`.
        """
        flat = [item for pair in info.as_fields().items() for item in pair]
        keys = [
            self.keys.version(info.version),
            self.keys.versions,
            self.keys.latest,
            self.keys.snapshots,
            self.keys.publisher_leader,
        ]
        args = [info.version, info.snapshot_id, event.encode(), self.keys.events, holder, *flat]
        return int(self._register(keys=keys, args=args))

    def live_versions(self) -> list[int]:
        return [int(v) for v in self.client.zrange(self.keys.versions, 0, -1)]

    def manifest_sha256(self, version: int) -> str:
        """The SHA-256 of ``version``'s manifest as registered (empty: no entry)."""
        return (self.client.hget(self.keys.version(version), "manifest_sha256") or b"").decode()

    def delta_from(self, version: int) -> int:
        """The version whose delta was written beside ``version`` (0: none, or no entry)."""
        return int(self.client.hget(self.keys.version(version), "delta_from") or 0)
