"""``weightcast status``: one read of the deployment's state, as a table or as JSON."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from shared.keys import TRAINER_GROUP, Keys


def collect_status(client: redis.Redis, keys: Keys) -> dict[str, Any]:
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
                "path": fields.get("path", ""),
                "leases": leases,
            }
        )
    nodes = {}
    for node, value in client.hgetall(keys.nodes).items():
        entry = json.loads(value)
        nodes[node.decode()] = {"version": entry["version"], "age_s": round(now - entry["at"], 1)}
    heartbeat = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer_heartbeat).items()}
    if heartbeat:
        heartbeat["age_s"] = round(now - float(heartbeat.pop("at")), 1)
    return {
        "namespace": keys.namespace,
        "latest": int(client.get(keys.latest) or 0),
        "versions": versions,
        "nodes": nodes,
        "trainer": heartbeat,
        "stream": _stream_status(client, keys),
    }


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
    lines = [f"namespace {status['namespace']}   latest version: {status['latest'] or '-'}", ""]
    lines.append(f"{'version':>7} {'step':>6} {'age':>8} {'size':>10} {'tp':>3}  leases")
    for v in status["versions"]:
        leases = ", ".join(f"{n} ({s}s)" for n, s in v["leases"].items()) or "-"
        lines.append(
            f"{v['version']:>7} {v['step']:>6} {v['age_s']:>7}s "
            f"{_size(v['bytes']):>10} {v['tp']:>3}  {leases}"
        )
    if not status["versions"]:
        lines.append("   (no live versions)")
    lines += ["", "nodes:"]
    for node, n in sorted(status["nodes"].items()):
        lines.append(f"  {node}: version {n['version']} ({n['age_s']}s ago)")
    if not status["nodes"]:
        lines.append("  (none)")
    trainer = status["trainer"]
    lines += [
        "",
        "trainer: "
        + (
            f"step {trainer['step']}, run {trainer['run_id']}, consumer {trainer['consumer']}, "
            f"last snapshot {trainer['last_snapshot'] or '-'}, heartbeat {trainer['age_s']}s ago"
            if trainer
            else "no heartbeat yet"
        ),
    ]
    s = status["stream"]
    lines.append(
        f"batches: {s['length']} in stream, {s['undelivered'] or 0} undelivered, "
        f"{s['pending']} pending, {s['dead_letters']} dead-lettered"
    )
    return "\n".join(lines)


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"
