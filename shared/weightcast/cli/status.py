"""``weightcast status``: one read of the deployment's state, as a table or as JSON.

Latest version and its age, live versions with their leases, inference nodes with the
version each runs (stale ones marked), the active publisher and the snapshots it quarantined,
the trainer's heartbeat (the table shows the figures that matter, rounded; ``--json`` every
field it writes) and the batch stream's depths. ``--watch`` rides out a Redis outage
(``redis_retry_seconds``), saying so on screen while it lasts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import redis

from weightcast.contract.errors import RecordError, WeightsError
from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.nodes import NodeReport
from weightcast.contract.quarantine import QuarantineRecord
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.retry import REDIS_DOWN, Outage

HEARTBEAT_FIGURES = (
    "loss",
    "kl",
    "grad_norm",
    "tokens_per_s",
    "step_seconds",
    "last_policy_lag",
    "mismatch_kl",
    "pending",
    "dead_lettered",
    "checkpoint_step",
)
"""Heartbeat figures the table shows after step, run, consumer and snapshot (``--json``
has them all)."""

CLEAR = "\x1b[H\x1b[2J"
"""Cursor home and clear screen: ``--watch`` redraws in place."""


@dataclass(frozen=True)
class VersionRow:
    """A live version and who leases it."""

    version: int
    step: int
    age_s: float
    bytes: int
    tp: int
    layout: str
    path: str
    leases: dict[str, float]
    """Reader id -> seconds its lease has left."""
    error: str = ""
    """Why its registry entry is unreadable (step -1, the other figures 0); empty if it is not."""


@dataclass(frozen=True)
class NodeRow:
    """An inference node's last report, and whether it is stale."""

    version: int
    age_s: float
    behind: int
    """Versions between latest and the one it serves."""
    stale: str
    """Why the row is stale (no recent report, its version evicted); empty if it is not."""
    error: str
    via: str
    read_bytes: int


@dataclass(frozen=True)
class QuarantineRow:
    snapshot: str
    step: int | None
    reason: str
    age_s: float


@dataclass(frozen=True)
class PublisherStatus:
    leader: str | None
    """The holder of the publisher lock; None when no one holds it."""
    quarantined: list[QuarantineRow]
    """Newest first."""


@dataclass(frozen=True)
class TrainerStatus:
    heartbeat: Heartbeat | None
    """None before the first heartbeat, or when it is unreadable (``error``)."""
    age_s: float | None = None
    error: str = ""

    def as_json(self) -> dict[str, Any]:
        """Every field the trainer wrote, as text (its own fields too), with ``age_s`` for
        ``at``; or the ``error``."""
        if self.error:
            return {"error": self.error}
        if self.heartbeat is None:
            return {}
        fields: dict[str, Any] = self.heartbeat.encode() | dict(self.heartbeat.other)
        fields.pop("at", None)
        return fields if self.age_s is None else fields | {"age_s": self.age_s}


@dataclass(frozen=True)
class StreamStatus:
    length: int
    pending: int
    undelivered: int | None
    """Entries not yet delivered to the trainer group (None: no group yet)."""
    dead_letters: int


@dataclass(frozen=True)
class Status:
    """One read of the deployment (:func:`collect_status`); ``--json`` prints
    :meth:`as_json`."""

    namespace: str
    latest: int
    latest_age_s: float | None
    versions: list[VersionRow]
    nodes: dict[str, NodeRow]
    publisher: PublisherStatus
    trainer: TrainerStatus
    stream: StreamStatus
    delta_only: list[int] = dataclasses.field(default_factory=list)
    """Delta-only versions (``{wc}:weights:deltas``): evicted, their delta kept as a link of a
    node's chain."""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"trainer": self.trainer.as_json()}


def collect_status(client: redis.Redis, keys: Keys, stale_seconds: float = 60.0) -> Status:
    """Versions with their leases, nodes, trainer heartbeat and queue depths; each record
    read through its contract type, an unreadable one shown with the reason."""
    now = time.time()
    versions = [
        row
        for raw in client.zrange(keys.versions, 0, -1)
        if (row := _version_row(client, keys, int(raw), now)) is not None
    ]
    live = {v.version for v in versions}
    latest = int(client.get(keys.latest) or 0)
    nodes = {}
    for node, value in client.hgetall(keys.nodes).items():
        try:
            report = NodeReport.parse(value)
        except ValueError as exc:  # not what a node writes
            report = NodeReport(0, now, f"unreadable entry in {keys.nodes}: {exc}")
        age = round(now - report.at, 1)
        stale = []
        if age > stale_seconds:
            stale.append(f"no report for {age:.0f}s")
        if report.version not in live:
            stale.append(f"v{report.version} was evicted")
        nodes[node.decode(errors="replace")] = NodeRow(
            report.version,
            age,
            max(0, latest - report.version),
            "; ".join(stale),
            report.error,
            report.via,
            report.read_bytes,
        )
    latest_row = next((v for v in versions if v.version == latest and not v.error), None)
    return Status(
        keys.namespace,
        latest,
        latest_row.age_s if latest_row else None,
        versions,
        nodes,
        _publisher_status(client, keys, now),
        _trainer_status(client, keys, now),
        _stream_status(client, keys),
        [int(raw) for raw in client.zrange(keys.deltas, 0, -1)],
    )


def _version_row(client: redis.Redis, keys: Keys, number: int, now: float) -> VersionRow | None:
    """A live version's row; None when it was evicted since the live set was read."""
    raw = client.hgetall(keys.version(number))
    if not raw:
        return None
    now_ms = now * 1000
    leases = {
        node.decode(errors="replace"): round((expiry - now_ms) / 1000, 1)
        for node, expiry in client.zrange(keys.leases(number), 0, -1, withscores=True)
        if expiry > now_ms
    }
    try:
        info = VersionInfo.from_fields(number, raw)
    except WeightsError as exc:  # not what a publisher writes
        return VersionRow(number, -1, 0.0, 0, 0, "", "", leases, f"unreadable entry: {exc}")
    age = round(now - info.created_at, 1)
    return VersionRow(number, info.step, age, info.bytes, info.tp, info.layout, info.path, leases)


def _trainer_status(client: redis.Redis, keys: Keys, now: float) -> TrainerStatus:
    raw = client.hgetall(keys.trainer_heartbeat)
    if not raw:
        return TrainerStatus(None)
    try:
        beat = Heartbeat.parse(raw)
    except RecordError as exc:  # not what a trainer writes
        return TrainerStatus(None, error=f"unreadable {keys.trainer_heartbeat}: {exc}")
    return TrainerStatus(beat, None if beat.at is None else round(now - beat.at, 1))


def _publisher_status(client: redis.Redis, keys: Keys, now: float) -> PublisherStatus:
    """The leader lock's holder and every quarantined snapshot with its reason, newest first."""
    leader = client.get(keys.publisher_leader)
    quarantined = []
    for name, value in client.hgetall(keys.quarantine).items():
        try:
            record = QuarantineRecord.parse(value)
        except RecordError as exc:  # not what a publisher writes
            record = QuarantineRecord(
                f"unreadable entry in {keys.quarantine}: {exc}", None, "", now
            )
        snapshot = name.decode(errors="replace")
        quarantined.append(
            QuarantineRow(snapshot, record.step, record.reason, round(now - record.at, 1))
        )
    quarantined.sort(key=lambda q: q.age_s)
    return PublisherStatus(leader.decode(errors="replace") if leader else None, quarantined)


def _stream_status(client: redis.Redis, keys: Keys) -> StreamStatus:
    length, dead_letters = client.xlen(keys.batches), client.xlen(keys.dead_letters)
    try:
        groups = client.xinfo_groups(keys.batches)
    except redis.ResponseError:  # no stream yet
        return StreamStatus(length, 0, None, dead_letters)
    for group in groups:
        if group["name"].decode() == TRAINER_GROUP:
            return StreamStatus(length, group["pending"], group.get("lag"), dead_letters)
    return StreamStatus(length, 0, None, dead_letters)


def format_status(status: Status) -> str:
    """A readable table of :func:`collect_status`'s answer."""
    age = status.latest_age_s
    latest = f"{status.latest or '-'}" + (f" ({age}s old)" if age is not None else "")
    lines = [f"namespace {status.namespace}   latest version: {latest}", ""]
    lines.append(f"{'version':>7} {'step':>6} {'age':>8} {'size':>10} {'tp':>3}  leases")
    for v in status.versions:
        leases = ", ".join(f"{n} ({s}s left)" for n, s in v.leases.items()) or "-"
        if v.error:
            lines.append(f"{v.version:>7}  {v.error}; leases: {leases}")
            continue
        lines.append(
            f"{v.version:>7} {v.step:>6} {v.age_s:>7}s {_size(v.bytes):>10} {v.tp:>3}  {leases}"
        )
    if not status.versions:
        lines.append("   (no live versions)")
    if status.delta_only:
        listed = ", ".join(f"v{v}" for v in status.delta_only)
        lines.append(f"delta-only (links of delta chains): {listed}")
    lines += ["", "nodes:"]
    for node, n in sorted(status.nodes.items()):
        behind = f", {n.behind} behind latest" if n.behind else ""
        stale = f"  STALE: {n.stale}" if n.stale else ""
        error = f"  ERROR: {n.error}" if n.error else ""
        via = f", by {n.via}: {_size(n.read_bytes)} read" if n.via else ""
        lines.append(f"  {node}: v{n.version} (reported {n.age_s}s ago{behind}{via}){stale}{error}")
    if not status.nodes:
        lines.append("  (none)")
    publisher = status.publisher
    lines += ["", f"publisher: leader {publisher.leader or '- (none holds the lock)'}"]
    for q in publisher.quarantined:
        lines.append(f"  quarantined {q.snapshot} ({q.age_s}s ago): {q.reason}")
    lines += ["", "trainer: " + _format_heartbeat(status.trainer)]
    s = status.stream
    lines.append(
        f"batches: {s.length} in stream, {s.undelivered or 0} undelivered, "
        f"{s.pending} pending, {s.dead_letters} dead-lettered"
    )
    return "\n".join(lines)


def _format_heartbeat(trainer: TrainerStatus) -> str:
    beat = trainer.heartbeat
    if beat is None:
        return trainer.error or "no heartbeat yet"
    known = [
        f"step {beat.step}" if beat.step is not None else "",
        f"run {beat.run_id}" if beat.run_id is not None else "",
        f"consumer {beat.consumer}" if beat.consumer is not None else "",
        f"last snapshot {beat.last_snapshot or '-'}",
    ]
    written = dict(beat.values())
    figures = [f"{k} {_rounded(written[k])}" for k in HEARTBEAT_FIGURES if k in written]
    if beat.last_checkpoint_error:
        figures.append(f"checkpoint error: {beat.last_checkpoint_error}")
    age = f"heartbeat {trainer.age_s}s ago" if trainer.age_s is not None else ""
    return ", ".join(part for part in (*known, age) if part) + (
        "\n         " + ", ".join(figures) if figures else ""
    )


def _rounded(value: int | float | str) -> str:
    """A heartbeat figure to four significant digits (whole from 1000 on)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if value.is_integer() or abs(value) >= 1000 else f"{value:.4g}"


def watch(
    read: Callable[[], Status],
    every: float,
    as_json: bool,
    out: TextIO = sys.stdout,
    outage: Outage | None = None,
) -> int:
    """Redraw the status every ``every`` seconds until Ctrl-C (JSON: one line per read).

    While Redis is unreachable it retries (``outage``'s back-off and budget; the table says
    so, JSON lines pause). A reader that goes away (``status --watch --json | head``) ends
    it quietly too.
    """
    outage = outage or Outage()
    # Python leaves SIGINT ignored when started from a background job; Ctrl-C and SIGTERM
    # must stop a watch whatever the parent did.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    try:
        while True:
            try:
                status = read()
            except REDIS_DOWN as exc:
                pause = outage.failed(exc, "reading the status")
                if not as_json:
                    out.write(f"{CLEAR}Redis unreachable ({outage.last_error}); retrying\n")
                    out.flush()
                time.sleep(pause)
                continue
            outage.recovered()
            if as_json:
                out.write(json.dumps(status.as_json()) + "\n")
            else:
                stamp = time.strftime("%H:%M:%S")
                out.write(
                    f"{CLEAR}{format_status(status)}\n\n{stamp}, every {every:g}s; Ctrl-C to stop\n"
                )
            out.flush()
            time.sleep(every)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"
