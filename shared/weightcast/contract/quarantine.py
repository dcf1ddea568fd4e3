"""Why the publisher quarantined a snapshot: the value of ``{wc}:weights:quarantine``, whose
field is the snapshot id (or the directory name of a snapshot with no readable id).

The publisher writes it and prunes the oldest (``publisher.keep_records``); ``weightcast
status`` shows it. The hash is writable by anyone with access to Redis, so both read it
through :meth:`QuarantineRecord.parse`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weightcast.contract.errors import RecordError
from weightcast.contract.untrusted import Fields, json_object


@dataclass(frozen=True)
class QuarantineRecord:
    """A snapshot moved aside to ``path`` at unix time ``at``, for ``reason``; ``step`` is
    None when its directory name did not say."""

    reason: str
    step: int | None
    path: str
    at: float

    def encode(self) -> str:
        record = {"reason": self.reason, "step": self.step, "path": self.path, "at": self.at}
        return json.dumps(record)

    @classmethod
    def parse(cls, data: bytes | str) -> QuarantineRecord:
        """A record as the publisher writes it; :class:`RecordError` naming the field
        otherwise."""
        raw = json_object(data, "the quarantine record", RecordError)
        fields = Fields(raw, "", RecordError, _FIELDS, "the quarantine record")
        return cls(
            fields.text("reason"),
            fields.optional_integer("step"),
            fields.text("path"),
            fields.number("at"),
        )


_FIELDS = ("reason", "step", "path", "at")
