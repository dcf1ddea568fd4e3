"""The record of an inference node in ``{wc}:nodes``: field the node id, value this JSON.

Nodes write it (``report_loaded``), ``weightcast status`` and ``weightcast up`` read it, and
the publisher prunes the records that stopped coming (``publisher.node_retention_seconds``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from weightcast.contract.untrusted import json_object

VIAS = ("", "delta", "chain", "full")
"""How a node got the version it serves (empty: a node that does not say)."""


@dataclass(frozen=True)
class NodeReport:
    """The version a node serves (0: none yet), when it said so, and its last error."""

    version: int
    at: float
    """Unix time of the report."""
    error: str = ""
    """Why the last version offered was not loaded (``follow --vllm-url``); empty if it was."""
    via: str = ""
    """How the version served was read: ``delta``, ``chain`` (the deltas of several versions
    in a row), ``full`` (empty: not said, older nodes)."""
    read_bytes: int = 0
    """The bytes read to load it (the delta's frames, or the version's blocks)."""

    def encode(self) -> str:
        record: dict[str, object] = {"version": self.version, "at": self.at}
        if self.error:
            record["error"] = self.error
        if self.via:
            record |= {"via": self.via, "read_bytes": self.read_bytes}
        return json.dumps(record)

    @classmethod
    def parse(cls, data: bytes | str) -> NodeReport:
        """A record as a node wrote it; :class:`ValueError` saying what is wrong otherwise
        (the hash is writable by anyone with access to Redis)."""
        record = json_object(data, "the node record", ValueError)
        version, at, error = record.get("version"), record.get("at"), record.get("error", "")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"the node record's version {version!r} is not an integer >= 0")
        if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
            raise ValueError(f"the node record's time {at!r} is not a number")
        if not isinstance(error, str):
            raise ValueError(f"the node record's error {error!r} is not a string")
        via, read_bytes = record.get("via", ""), record.get("read_bytes", 0)
        if via not in VIAS:
            raise ValueError(f"the node record's via {via!r} is not one of delta, chain, full")
        if type(read_bytes) is not int or read_bytes < 0:
            raise ValueError(f"the node record's read_bytes {read_bytes!r} is not an integer >= 0")
        return cls(version, float(at), error, via, read_bytes)
