"""A publisher process killed with SIGKILL mid-upload to a real S3 server (SeaweedFS): nothing is
registered, and the next leader removes what it left (objects, unfinished multipart uploads)
without touching the registered versions, then publishes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis

from weightcast.contract.keys import Keys
from weightcast.contract.manifest import MANIFEST_NAME
from weightcast.contract.model_shape import ModelShape
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server

from helpers.processes import run_env, start_weightcast, stop
from helpers.s3 import s3_client, s3_process_env
from helpers.versions import publish_snapshot

# About 95 MB in bf16, written as 4 per-rank files of about 24 MB (two multipart parts each),
# uploaded one after the other with the manifest last: a kill lands between the first object
# and the manifest.
SHAPE = ModelShape(
    num_layers=12,
    hidden_size=512,
    intermediate_size=2048,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    vocab_size=1024,
    tie_word_embeddings=True,
)
PREFIX = "run/"


def objects(s3: Any, bucket: str, version: str) -> dict[str, str]:
    """The objects of ``version`` in the bucket: name -> ETag."""
    reply = s3.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}{version}/")
    return {
        o["Key"].removeprefix(f"{PREFIX}{version}/"): o["ETag"] for o in reply.get("Contents", [])
    }


def unfinished(s3: Any, bucket: str) -> list[str]:
    reply = s3.list_multipart_uploads(Bucket=bucket, Prefix=PREFIX)
    return [u["Key"] for u in reply.get("Uploads", [])]


def wait_until(condition, what: str, daemon, log: Path, timeout: float = 120, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert daemon.poll() is None, (
            f"publisher exited while waiting for {what}:\n{log.read_text()}"
        )
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()}"
        time.sleep(every)
    return result


def test_a_publisher_killed_mid_upload_leaves_nothing_registered_and_its_successor_cleans_up(
    redis_server: RedisServer,
    client: redis.Redis,
    keys: Keys,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    env = s3_process_env(s3_server, run_env(redis_server.url, keys.namespace, tmp_path))
    env.update(
        WEIGHTCAST_WEIGHTS_URL=f"s3://{s3_bucket}/run",
        WEIGHTCAST_S3_ENDPOINT_URL=s3_server.endpoint_url,
        WEIGHTCAST_S3_ADDRESSING_STYLE="path",
        WEIGHTCAST_PUBLISHER_TP="4",
        WEIGHTCAST_PUBLISHER_PER_RANK_FILES="true",
        WEIGHTCAST_PUBLISHER_RESCAN_SECONDS="0.3",
        WEIGHTCAST_PUBLISHER_LEADER_TTL_SECONDS="1",
    )
    s3 = s3_client(s3_server, retries=3)
    checkpoints = tmp_path / "checkpoints"
    log = tmp_path / "publisher-1.log"
    daemon = start_weightcast(env, log, "publisher")
    try:
        publish_snapshot(checkpoints, 1, SHAPE)
        wait_until(lambda: client.get(keys.latest), "version 1", daemon, log)
        registered = objects(s3, s3_bucket, "v1")
        assert MANIFEST_NAME in registered and len(registered) >= 5, registered

        publish_snapshot(checkpoints, 2, SHAPE)

        def mid_upload() -> bool:
            started = objects(s3, s3_bucket, "v2")
            return bool(started or unfinished(s3, s3_bucket)) and MANIFEST_NAME not in started

        wait_until(mid_upload, "the upload of version 2", daemon, log, every=0.01)
        daemon.kill()
        daemon.wait()
    finally:
        stop(daemon)
    left = objects(s3, s3_bucket, "v2")
    pending = unfinished(s3, s3_bucket)
    assert MANIFEST_NAME not in left and (left or pending), (left, pending)
    assert "uploaded version" not in log.read_text().split("published version", 1)[1]
    assert int(client.get(keys.latest)) == 1  # nothing registered
    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == [1]

    log = tmp_path / "publisher-2.log"
    daemon = start_weightcast(env, log, "publisher")
    try:
        wait_until(
            lambda: int(client.get(keys.latest)) > 2, "the snapshot published again", daemon, log
        )
        assert stop(daemon) == 0
    finally:
        stop(daemon)
    text = log.read_text()
    assert "removed leftovers of an earlier run" in text, text
    newest = int(client.get(keys.latest))
    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == [1, newest]
    assert objects(s3, s3_bucket, "v1") == registered  # the registered version untouched
    assert objects(s3, s3_bucket, "v2") == {}  # the killed upload's objects removed
    assert unfinished(s3, s3_bucket) == []  # and its multipart uploads aborted
    assert MANIFEST_NAME in objects(s3, s3_bucket, f"v{newest}")
    names = {o["Key"].split("/")[1] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert names == {"v1", f"v{newest}"}
