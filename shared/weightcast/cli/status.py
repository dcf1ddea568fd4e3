"""``weightcast status``: one read of the deployment's state, as a table or as JSON.

Latest version and its age, live versions with their leases, inference nodes with the
version each runs (stale ones marked), the active publisher and the snapshots it quarantined,
the trainer's heartbeat (the table shows the figures that matter, rounded; ``--json`` every
field it writes) and the batch stream's depths. ``--watch`` rides out a Redis outage
(``redis_retry_seconds``), saying so on screen while it lasts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.nodes import NodeReport
from weightcast.contract.untrusted import json_object
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


def collect_status(client: redis.Redis, keys: Keys, stale_seconds: float = 60.0) -> dict[str, Any]:
    """Versions with their leases, nodes, trainer heartbeat and queue depths."""
    now = time.time()
    now_ms = now * 1000
    versions = []
    for raw in client.zrange(keys.versions, 0, -1):
        number = int(raw)
        fields = {k.decode(): v.decode() for k, v in client.hgetall(keys.version(number)).items()}
        leases = {
            node.decode(): round((expiry - now_ms) / 1000, 1)
            for node, expiry in client.zrange(keys.leases(number), 0, -1, withscores=True)
            if expiry > now_ms
        }
        versions.append(
            {
                "version": number,
                "step": int(fields.get("step", -1)),
                "age_s": round(now - float(fields.get("created_at", now)), 1),
                "bytes": int(fields.get("bytes", 0)),
                "tp": int(fields.get("tp", 1)),
                "layout": fields.get("layout", ""),
                "path": fields.get("path", ""),
                "leases": leases,
            }
        )
    live = {v["version"] for v in versions}
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
        nodes[node.decode(errors="replace")] = {
            "version": report.version,
            "age_s": age,
            "behind": max(0, latest - report.version),
            "stale": "; ".join(stale),
            "error": report.error,
            "via": report.via,
            "read_bytes": report.read_bytes,
        }
    heartbeat: dict[str, Any] = {
        k.decode(): v.decode() for k, v in client.hgetall(keys.trainer_heartbeat).items()
    }
    if "at" in heartbeat:
        heartbeat["age_s"] = round(now - float(heartbeat.pop("at")), 1)
    latest_info = next((v for v in versions if v["version"] == latest), None)
    return {
        "namespace": keys.namespace,
        "latest": latest,
        "latest_age_s": latest_info["age_s"] if latest_info else None,
        "versions": versions,
        "nodes": nodes,
        "publisher": _publisher_status(client, keys, now),
        "trainer": heartbeat,
        "stream": _stream_status(client, keys),
    }


def _publisher_status(client: redis.Redis, keys: Keys, now: float) -> dict[str, Any]:
    """The leader lock's holder and every quarantined snapshot with its reason, newest first."""
    leader = client.get(keys.publisher_leader)
    quarantined = []
    for name, value in client.hgetall(keys.quarantine).items():
        try:
            entry = json_object(value, "its entry", ValueError)
            at = float(entry.get("at", now))
        except (ValueError, TypeError) as exc:  # not what a publisher writes
            entry, at = {"reason": f"unreadable entry in {keys.quarantine}: {exc}"}, now
        quarantined.append(
            {
                "snapshot": name.decode(errors="replace"),
                "step": entry.get("step"),
                "reason": str(entry.get("reason", "")),
                "age_s": round(now - at, 1),
            }
        )
    quarantined.sort(key=lambda q: q["age_s"])
    return {"leader": leader.decode() if leader else None, "quarantined": quarantined}


def _stream_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
    status = {
        "length": client.xlen(keys.batches),
        "pending": 0,
        "undelivered": None,
        "dead_letters": client.xlen(keys.dead_letters),
    }
    try:
        groups = client.xinfo_groups(keys.batches)
    except redis.ResponseError:  # no stream yet
        return status
    for group in groups:
        if group["name"].decode() == TRAINER_GROUP:
            status["pending"] = group["pending"]
            status["undelivered"] = group.get("lag")
    return status


def format_status(status: dict[str, Any]) -> str:
    """A readable table of :func:`collect_status`'s answer."""
    age = status["latest_age_s"]
    latest = f"{status['latest'] or '-'}" + (f" ({age}s old)" if age is not None else "")
    lines = [f"namespace {status['namespace']}   latest version: {latest}", ""]
    lines.append(f"{'version':>7} {'step':>6} {'age':>8} {'size':>10} {'tp':>3}  leases")
    for v in status["versions"]:
        leases = ", ".join(f"{n} ({s}s left)" for n, s in v["leases"].items()) or "-"
        lines.append(
            f"{v['version']:>7} {v['step']:>6} {v['age_s']:>7}s "
            f"{_size(v['bytes']):>10} {v['tp']:>3}  {leases}"
        )
    if not status["versions"]:
        lines.append("   (no live versions)")
    lines += ["", "nodes:"]
    for node, n in sorted(status["nodes"].items()):
        behind = f", {n['behind']} behind latest" if n["behind"] else ""
        stale = f"  STALE: {n['stale']}" if n["stale"] else ""
        error = f"  ERROR: {n['error']}" if n["error"] else ""
        via = f", by {n['via']}: {_size(n['read_bytes'])} read" if n["via"] else ""
        lines.append(
            f"  {node}: v{n['version']} (reported {n['age_s']}s ago{behind}{via}){stale}{error}"
        )
    if not status["nodes"]:
        lines.append("  (none)")
    publisher = status["publisher"]
    lines += ["", f"publisher: leader {publisher['leader'] or '- (none holds the lock)'}"]
    for q in publisher["quarantined"]:
        lines.append(f"  quarantined {q['snapshot']} ({q['age_s']}s ago): {q['reason']}")
    lines += ["", "trainer: " + _format_heartbeat(status["trainer"])]
    s = status["stream"]
    lines.append(
        f"batches: {s['length']} in stream, {s['undelivered'] or 0} undelivered, "
        f"{s['pending']} pending, {s['dead_letters']} dead-lettered"
    )
    return "\n".join(lines)


def _format_heartbeat(heartbeat: dict[str, Any]) -> str:
    if not heartbeat:
        return "no heartbeat yet"
    known = [
        f"step {heartbeat['step']}" if "step" in heartbeat else "",
        f"run {heartbeat['run_id']}" if "run_id" in heartbeat else "",
        f"consumer {heartbeat['consumer']}" if "consumer" in heartbeat else "",
        f"last snapshot {heartbeat.get('last_snapshot') or '-'}",
    ]
    figures = [f"{k} {_rounded(heartbeat[k])}" for k in HEARTBEAT_FIGURES if k in heartbeat]
    if heartbeat.get("last_checkpoint_error"):
        figures.append(f"checkpoint error: {heartbeat['last_checkpoint_error']}")
    age = f"heartbeat {heartbeat['age_s']}s ago" if "age_s" in heartbeat else ""
    return ", ".join(part for part in (*known, age) if part) + (
        "\n         " + ", ".join(figures) if figures else ""
    )


def _rounded(value: str) -> str:
    """A heartbeat figure to four significant digits (whole from 1000 on); text as it is."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.0f}" if number.is_integer() or abs(number) >= 1000 else f"{number:.4g}"


def watch(
    read: Callable[[], dict[str, Any]],
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
                out.write(json.dumps(status) + "\n")
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
