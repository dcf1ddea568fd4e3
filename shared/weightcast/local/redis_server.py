"""A private ``redis-server`` on a free loopback port, for ``weightcast up`` and the tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from weightcast.contract.errors import WeightcastError
from weightcast.runtime.net import free_port


class RedisServerError(WeightcastError):
    """redis-server is missing, exited, or did not answer; the message says which."""


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError(
            "redis-server not found on PATH: install it (Debian: apt-get install redis-server) "
            "or point weightcast at a running server with --redis-url"
        )
    return path


class RedisServer:
    """Runs ``redis-server`` bound to 127.0.0.1 with its files in ``data_dir``.

    ``appendonly`` turns on AOF so that a restart on the same ``data_dir`` keeps the data
    (the tests restart it to show that the daemons survive). Use as a context manager.
    """

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = False):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    find_redis_server(),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.data_dir.resolve()),
                    "--save",
                    "",
                    "--appendonly",
                    "yes" if self.appendonly else "no",
                    "--protected-mode",
                    "yes",
                    "--daemonize",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RedisServerError(
                    f"redis-server exited with code {self.process.returncode}; "
                    f"see {self.data_dir / 'redis.log'}"
                )
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerError(f"redis-server did not answer PING within {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
