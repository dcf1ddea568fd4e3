"""The events on ``{wc}:weights:events`` (pub/sub), one JSON object each.

The publisher sends :class:`Published` (its registration script) and :class:`Evicted` (the
eviction script, :mod:`weightcast.contract.leases`). They only wake readers: a reader that
misses one finds the version by re-reading ``latest``. Whoever reads one through
:func:`parse_event` gets it checked: anyone with access to Redis can publish on the channel.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weightcast.contract.errors import RecordError
from weightcast.contract.untrusted import Fields, json_object

PUBLISHED = "published"
EVICTED = "evicted"


@dataclass(frozen=True)
class Published:
    """Version ``version`` (of training step ``step``) is registered, ``lag_s`` seconds
    after the trainer wrote its snapshot ``snapshot_id``; ``path`` as registered. Its delta
    holds ``delta_bytes`` (0: none), and ``no_delta`` says why it has none although it had
    a base (the registry entry's reason, so a watcher need not read the entry)."""

    version: int
    step: int
    lag_s: float
    path: str
    snapshot_id: str
    delta_bytes: int = 0
    no_delta: str = ""

    def encode(self) -> str:
        fields = {
            "event": PUBLISHED,
            "version": self.version,
            "step": self.step,
            "lag_s": self.lag_s,
            "path": self.path,
            "snapshot_id": self.snapshot_id,
            "delta_bytes": self.delta_bytes,
        }
        if self.no_delta:
            fields["no_delta"] = self.no_delta
        return json.dumps(fields)


@dataclass(frozen=True)
class Evicted:
    """Version ``version`` is no longer live: its directory is being removed."""

    version: int

    def encode(self) -> str:
        return json.dumps({"event": EVICTED, "version": self.version})


Event = Published | Evicted


def parse_event(data: bytes | str) -> Event:
    """An event as the publisher sends it; :class:`RecordError` saying what is wrong
    otherwise (an unknown kind included)."""
    raw = json_object(data, "the event", RecordError)
    kind = raw.get("event")
    if kind == PUBLISHED:
        fields = Fields(raw, "", RecordError, _PUBLISHED_FIELDS, "the published event")
        return Published(
            fields.integer("version", 1),
            fields.integer("step"),
            fields.number("lag_s"),
            fields.text("path"),
            fields.text("snapshot_id"),
            fields.integer("delta_bytes", default=0),  # absent from an older publisher's
            fields.text("no_delta") if "no_delta" in raw else "",
        )
    if kind == EVICTED:
        fields = Fields(raw, "", RecordError, ("event", "version"), "the evicted event")
        return Evicted(fields.integer("version", 1))
    raise RecordError(f"the event's kind {kind!r} is not one of {PUBLISHED}, {EVICTED}")


_PUBLISHED_FIELDS = (
    "event",
    "version",
    "step",
    "lag_s",
    "path",
    "snapshot_id",
    "delta_bytes",
    "no_delta",
)
