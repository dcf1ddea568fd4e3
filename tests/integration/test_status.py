"""``weightcast status`` on a real deployment: versions, leases, nodes, heartbeat, queue."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import redis

from weightcast.cli.status import CLEAR
from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer

from helpers.files import REPO
from helpers.models import SMALL_GQA
from helpers.processes import run_weightcast, weightcast
from helpers.redis_state import push_batches
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment


def test_status_shows_versions_leases_stale_nodes_heartbeat_and_queue(
    cli_env: dict[str, str],
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url)
    for _ in range(3):
        deployment.publish()  # keep-last-two: v1 is evicted
    broken = write_snapshot(tmp_path / "checkpoints", 9, SMALL_GQA)
    (broken / "config.json").unlink()
    deployment.publisher.scan_once()  # quarantined, with its reason in Redis
    client.set(keys.publisher_leader, "publisher-host-1", px=10_000)
    reader = deployment.reader("node-fresh")
    reader.report_loaded(3)
    now = time.time()
    client.hset(keys.nodes, "node-silent", json.dumps({"version": 2, "at": now - 500}))
    client.hset(keys.nodes, "node-evicted", json.dumps({"version": 1, "at": now}))
    client.hset(
        keys.trainer_heartbeat,
        mapping={
            "step": 7,
            "run_id": "r1",
            "consumer": "c1",
            "last_snapshot": "/x/step-6",
            "at": now - 2,
            "custom_field": 42,
            "loss": 0.69314718055994530,
            "checkpoint_seconds": 0.20214514500003133,
            "tokens_per_s": 12345.678,
            "pending": 3,
        },
    )
    push_batches(redis_server.url, keys, 2, policy_version=3)
    with reader.lease(2):
        view = json.loads(
            run_weightcast(cli_env, "status", "--json", "--stale-seconds", "30").stdout
        )
        table = run_weightcast(cli_env, "status", "--stale-seconds", "30").stdout
    assert view["latest"] == 3 and 0 <= view["latest_age_s"] < 60
    assert [v["version"] for v in view["versions"]] == [2, 3]
    assert list(view["versions"][0]["leases"]) == ["node-fresh"]
    nodes = view["nodes"]
    assert nodes["node-fresh"]["stale"] == "" and nodes["node-fresh"]["behind"] == 0
    assert nodes["node-silent"]["stale"].startswith("no report for 5")
    assert nodes["node-silent"]["behind"] == 1
    assert nodes["node-evicted"]["stale"] == "v1 was evicted"
    assert view["publisher"]["leader"] == "publisher-host-1"
    (quarantined,) = view["publisher"]["quarantined"]
    assert quarantined["step"] == 9 and "config.json missing" in quarantined["reason"]
    assert "publisher: leader publisher-host-1" in table
    assert f"quarantined {quarantined['snapshot']} (" in table
    assert view["trainer"]["step"] == "7" and view["trainer"]["custom_field"] == "42"
    assert view["stream"] == {"length": 2, "pending": 0, "undelivered": 2, "dead_letters": 0}
    assert "latest version: 3 (" in table
    assert "node-fresh (" in table and "s left)" in table
    assert "node-evicted: v1" in table and "STALE: v1 was evicted" in table
    assert "node-silent: v2" in table and "STALE: no report for" in table
    assert "node-fresh: v3 (reported" in table
    assert "step 7, run r1, consumer c1, last snapshot /x/step-6" in table
    assert "loss 0.6931, tokens_per_s 12346, pending 3" in table  # rounded, as versions
    assert "custom_field" not in table and "checkpoint_seconds" not in table  # --json has all
    assert view["trainer"]["checkpoint_seconds"] == "0.20214514500003133"
    assert "2 in stream, 2 undelivered, 0 pending, 0 dead-lettered" in table


def test_entries_no_node_publisher_or_trainer_wrote_are_shown_not_fatal(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys
) -> None:
    client.hset(keys.nodes, "node-garbage", "[" * 100_000)  # past the recursion limit
    client.hset(keys.nodes, "node-partial", json.dumps({"version": "two"}))
    client.hset(keys.quarantine, "step-7", "not json")
    client.zadd(keys.versions, {5: 5})
    client.hset(keys.version(5), mapping={"path": "v5", "step": "five"})
    client.hset(keys.trainer_heartbeat, mapping={"step": "3", "at": "soon"})
    view = json.loads(run_weightcast(cli_env, "status", "--json").stdout)
    table = run_weightcast(cli_env, "status").stdout
    for node in ("node-garbage", "node-partial"):
        assert view["nodes"][node]["error"].startswith(f"unreadable entry in {keys.nodes}")
        assert f"{node}: v0" in table
    (quarantined,) = view["publisher"]["quarantined"]
    assert quarantined["snapshot"] == "step-7"
    assert quarantined["reason"].startswith(f"unreadable entry in {keys.quarantine}")
    (version,) = view["versions"]
    assert version["version"] == 5 and version["step"] == -1
    assert (
        version["error"]
        == "unreadable entry: registry entry of version 5: step is 'five', not a int"
    )
    assert f"      5  {version['error']}; leases: -" in table
    assert view["trainer"] == {
        "error": f"unreadable {keys.trainer_heartbeat}: the trainer heartbeat: at is 'soon', "
        "not a float"
    }
    assert f"trainer: {view['trainer']['error']}" in table


def test_watch_redraws_in_place_until_interrupted(cli_env: dict[str, str]) -> None:
    for extra, marker in (([], CLEAR), (["--json"], '{"namespace"')):
        watcher = subprocess.Popen(
            weightcast("status", "--watch", "0.2", *extra),
            env=cli_env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        seen = ""
        while seen.count(marker) < 3:
            line = watcher.stdout.readline()
            assert line, "status --watch stopped by itself"
            seen += line
        watcher.send_signal(signal.SIGINT)
        watcher.communicate(timeout=30)  # drain stdout: a full pipe would block its last write
        assert watcher.returncode == 0
        if extra:
            assert all(json.loads(line)["latest"] == 0 for line in seen.splitlines())


def test_watch_ends_quietly_when_its_reader_goes_away(cli_env: dict[str, str]) -> None:
    """``weightcast status --watch --json | head -1`` must not end in a traceback."""
    watcher = subprocess.Popen(
        weightcast("status", "--watch", "0.05", "--json"),
        env=cli_env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert json.loads(watcher.stdout.readline())["latest"] == 0
    watcher.stdout.close()  # the reader leaves; the next writes hit a closed pipe
    assert watcher.wait(timeout=60) == 0
    assert "Traceback" not in watcher.stderr.read()
