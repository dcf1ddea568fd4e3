"""The trainer's heartbeat ``{wc}:trainer:heartbeat``: a hash of flat text fields.

Rank 0 writes it (``weightcast_trainer.telemetry``) every step and once a second while idle;
``weightcast status`` and ``weightcast up`` read it. A field appears once the trainer has a
value for it (no ``loss`` before the first step), and a field stays until overwritten, so
:class:`Heartbeat` holds None for a field not written. Anyone with access to Redis can write
the hash, so readers take it through :meth:`Heartbeat.parse`: a known field that is not its
kind is a :class:`RecordError`; fields this version does not know (a newer trainer's) are
kept as text in ``other``, shown and never interpreted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightcast.contract.errors import RecordError
from weightcast.contract.untrusted import HashFields


@dataclass(frozen=True)
class Heartbeat:
    """What the trainer last said, field by field (None: not written). A partial one is a
    change: :meth:`updated` applies it."""

    step: int | None = None
    """Optimizer steps in the train state."""
    run_id: str | None = None
    consumer: str | None = None
    world_size: int | None = None
    at: float | None = None
    """Unix time of the write."""
    last_snapshot: str | None = None
    """The directory of the last snapshot written (empty: none yet)."""
    last_checkpoint_error: str | None = None
    """Why the last resume checkpoint failed (empty: it did not)."""
    loss: float | None = None
    kl: float | None = None
    entropy: float | None = None
    clip_fraction: float | None = None
    grad_norm: float | None = None
    mismatch_kl: float | None = None
    mismatch_max: float | None = None
    mismatch_version: int | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    step_seconds: float | None = None
    queue_lag: int | None = None
    pending: int | None = None
    stale_dropped: int | None = None
    dead_lettered: int | None = None
    skipped_steps: int | None = None
    already_applied: int | None = None
    last_policy_lag: int | None = None
    """Latest version minus the policy version of the last trained batch (may be < 0)."""
    publish_skipped: int | None = None
    snapshots_written: int | None = None
    snapshots_skipped_no_space: int | None = None
    snapshot_stage_seconds: float | None = None
    snapshot_write_seconds: float | None = None
    checkpoint_step: int | None = None
    checkpoint_seconds: float | None = None
    checkpoint_failures: int | None = None
    other: Mapping[str, str] = field(default_factory=dict)
    """Fields this version does not know, as text (read only, never written)."""

    def updated(self, change: Heartbeat) -> Heartbeat:
        """This heartbeat with the fields ``change`` sets replaced."""
        return dataclasses.replace(self, **dict(change.values()))

    def values(self) -> list[tuple[str, int | float | str]]:
        """The fields written, by name."""
        return [(n, v) for n in _KINDS if (v := getattr(self, n)) is not None]

    def encode(self) -> dict[str, str]:
        """The fields written, as the hash holds them (a float as ``repr`` writes it)."""
        return {n: repr(float(v)) if _KINDS[n] is float else str(v) for n, v in self.values()}

    @classmethod
    def parse(cls, raw: Mapping[bytes | str, bytes | str]) -> Heartbeat:
        """The hash as redis-py returns it (or :meth:`encode`'s output); :class:`RecordError`
        naming the field that is not what the trainer writes."""
        fields = HashFields(raw, "the trainer heartbeat", RecordError)
        values: dict[str, int | float | str] = {}
        for name, kind in _KINDS.items():
            if name not in fields:
                continue
            if kind is str:
                values[name] = fields.text(name)
            elif kind is int:
                values[name] = fields.integer(name, signed=name == "last_policy_lag")
            else:
                values[name] = fields.number(name, finite=name == "at")
        return cls(**values, other=fields.unread())  # type: ignore[arg-type]


_KINDS: dict[str, type] = {
    item.name: {"int | None": int, "float | None": float, "str | None": str}[str(item.type)]
    for item in dataclasses.fields(Heartbeat)
    if item.name != "other"
}
"""Each written field's kind, from its annotation."""
