"""An engine's HTTP server as a process of the real-engine tiers (``vllm serve``, an SGLang
server): started on a free loopback port, waited for, called, stopped with its process group;
and a loopback HTTP server in a thread of the test's own (:func:`serving`)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A loopback HTTP server answering with ``handler`` in a thread, while inside; its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineServer:
    """A server started from ``model`` by :meth:`argv`, logging to ``log_path``."""

    model: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv(),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.tail()
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=5),
            ):
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.argv()[2]} not ready after {timeout}s\n{self.tail()}")

    def __enter__(self) -> Self:
        """Started and ready to answer (stopped if it never is)."""
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def call(self, method: str, route: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data, {"Content-Type": "application/json"}, method=method
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            return json.loads(reply.read())
