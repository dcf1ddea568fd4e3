"""The whole pipeline through real processes and a real redis-server.

A producer pushes good batches with malformed ones among them; a trainer process trains and
writes a snapshot every two steps; a publisher process converts, registers and evicts.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.manifest import Manifest, sha256_file, verify_files

from helpers import REPO, run_weightcast, weightcast

STEPS = 14
PUBLISH_EVERY = 2


def test_versions_flow_from_trainer_to_redis_and_disk(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    events = client.pubsub()
    events.subscribe(keys.events)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            return subprocess.Popen(
                weightcast(*args), env=cli_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )

    publisher = start("publisher", "publisher", "--rescan-seconds", "0.5")
    trainer = start(
        "trainer", "trainer", "--steps", str(STEPS), "--publish-every", str(PUBLISH_EVERY)
    )
    try:
        produced = run_weightcast(
            cli_env, "produce", "--count", str(STEPS), "--invalid-every", "5", "--interval", "0.5"
        )
        assert produced.returncode == 0, produced.stderr
        assert trainer.wait(timeout=180) == 0, (logs / "trainer.log").read_text()
        deadline = time.monotonic() + 60
        while (
            int(client.hget(keys.version(int(client.get(keys.latest) or 0)), "step") or 0) != STEPS
        ):
            assert publisher.poll() is None, (logs / "publisher.log").read_text()
            assert time.monotonic() < deadline, "the last snapshot was never published"
            time.sleep(0.2)
    finally:
        publisher.send_signal(signal.SIGTERM)
        assert publisher.wait(timeout=30) == 0, (logs / "publisher.log").read_text()
        if trainer.poll() is None:
            trainer.kill()

    trainer_log = (logs / "trainer.log").read_text()
    published = []
    while message := events.get_message(timeout=0.5):
        if message["type"] == "message" and json.loads(message["data"])["event"] == "published":
            published.append(json.loads(message["data"]))

    # The trainer skips a snapshot while the previous write still runs (a loaded machine).
    skipped = {int(s) for s in re.findall(r"snapshot skipped.* step=(\d+)", trainer_log)}
    written = [s for s in range(PUBLISH_EVERY, STEPS + 1, PUBLISH_EVERY) if s not in skipped]
    assert written[-1] == STEPS  # the last step is always written

    # Every version registered exactly once, in order, each from a newer snapshot.
    versions = [e["version"] for e in published]
    assert len(versions) >= len(written) - 1, f"only {versions} published of {written}"
    assert versions == list(range(1, len(versions) + 1))
    steps = [e["step"] for e in published]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    assert all(step % PUBLISH_EVERY == 0 for step in steps)
    assert int(client.get(keys.latest)) == versions[-1]

    # Exactly the two newest remain, in Redis and on disk, and nothing half-written.
    newest = versions[-2:]
    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == newest
    weights = tmp_path / "weights"
    assert sorted(p.name for p in weights.iterdir()) == sorted(f"v{v}" for v in newest)
    for version in versions[:-2]:
        assert not client.exists(keys.version(version))

    # Every registered path exists and matches its manifest.
    for version in newest:
        fields = {k.decode(): v.decode() for k, v in client.hgetall(keys.version(version)).items()}
        assert fields["path"] == f"v{version}"  # relative to the weights directory
        path = weights / fields["path"]
        manifest = Manifest.read(path)
        verify_files(path, manifest)
        assert sha256_file(path / "manifest.json") == fields["manifest_sha256"]
        assert (manifest.version, manifest.step, manifest.tp) == (
            version,
            int(fields["step"]),
            int(fields["tp"]),
        )
        assert int(fields["bytes"]) == manifest.total_bytes

    # Malformed batches went to the dead-letter stream with a reason; training went on.
    dead = client.xrange(keys.dead_letters)
    assert len(dead) == STEPS // 5
    for _, fields in dead:
        assert b"not a safetensors blob" in fields[b"reason"]
        assert fields[b"orig_id"]
    assert int(client.hget(keys.trainer_heartbeat, "step")) == STEPS
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0

    # Published and skipped snapshots were pruned to the newest two; no temp directories.
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == [f"step-{step}" for step in written[-2:]]

    # The operator's view agrees with what happened.
    status = run_weightcast(cli_env, "status", "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["latest"] == versions[-1]
    assert [v["version"] for v in view["versions"]] == newest
    assert view["trainer"]["step"] == str(STEPS)
    assert view["stream"] == {
        "length": 0,  # every entry acknowledged (trained or dead-lettered), so trimmed
        "pending": 0,
        "undelivered": 0,
        "dead_letters": STEPS // 5,
    }
    table = run_weightcast(cli_env, "status").stdout
    assert f"latest version: {versions[-1]}" in table and "2 dead-lettered" in table
