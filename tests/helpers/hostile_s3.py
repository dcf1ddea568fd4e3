"""An S3 endpoint that answers like a broken proxy or an attacker, for the tests that a node
survives one: a plain ``http.server`` on a free loopback port, answering every request with
one :data:`FAULTS` entry. It is no stand-in for S3 (functional tests use SeaweedFS): it holds
one object, ``OBJECT`` under any key, and knows only the requests a node sends (HEAD of the
bucket and of an object, ranged GETs, listings). Every loop it runs is bounded, and it stops
by itself after ``lifetime`` seconds.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self
from urllib.parse import parse_qs, urlsplit

OBJECT = bytes(range(256)) * 16
"""The object's bytes, whatever its key."""
ETAG = '"0123456789abcdef0123456789abcdef"'

HEAD_FAULTS = ("no-length", "negative-length", "text-length")
"""Faults of an object's HEAD answer (its GETs answer well)."""
GET_FAULTS = (
    "deep-error",
    "deep-error-small",
    "huge-error",
    "trickle",
    "stall",
    "reset",
    "short",
    "short-once",
    "long-length",
    "redirect",
    "etag-changes",
)
"""Faults of an object's ranged GETs (its HEAD answers well)."""
LIST_FAULTS = ("garbage-listing", "endless-listing", "truncated-no-token", "huge-listing")
"""Faults of a listing."""
FAULTS = (*HEAD_FAULTS, *GET_FAULTS, *LIST_FAULTS)

HUGE_BYTES = 256 * 1024 * 1024
"""What the huge error bodies and listings claim, and send as long as they are read."""
DEEP = 200_000


class HostileS3:
    """The endpoint, serving ``fault`` until the ``with`` block ends or ``lifetime`` passes."""

    def __init__(self, fault: str, lifetime: float = 60.0) -> None:
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        self.fault = fault
        self.lifetime = lifetime
        self.gets = 0
        """Ranged GETs answered so far."""
        self.stopped = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)
        self.timer = threading.Timer(lifetime, self.stop)

    @property
    def endpoint_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        self.thread.start()
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.thread.join()

    def stop(self) -> None:
        if not self.stopped.is_set():
            self.stopped.set()
            self.timer.cancel()
            self.server.shutdown()
            self.server.server_close()


def _handler(endpoint: HostileS3) -> type[BaseHTTPRequestHandler]:
    fault = endpoint.fault

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the test reads the client's outcome, not the server's log."""

        def do_HEAD(self) -> None:
            if urlsplit(self.path).path.strip("/").count("/") == 0:  # HEAD of the bucket
                self._head({"Content-Length": "0"})
            elif fault == "no-length":
                self._head({"ETag": ETAG})
            elif fault == "negative-length":
                self._head({"ETag": ETAG, "Content-Length": "-1"})
            elif fault == "text-length":
                self._head({"ETag": ETAG, "Content-Length": "4096 bytes"})
            else:
                self._head({"ETag": ETAG, "Content-Length": str(len(OBJECT))})

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            if "list-type" in parse_qs(parts.query):
                self._listing(parse_qs(parts.query).get("prefix", [""])[0])
            else:
                endpoint.gets += 1
                self._object()

        def _head(self, headers: dict[str, str]) -> None:
            self.send_response(200)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()

        def _object(self) -> None:
            first, last = (int(n) for n in self.headers["Range"][len("bytes=") :].split("-"))
            body = OBJECT[first : last + 1]
            if fault in ("deep-error", "deep-error-small"):
                depth = DEEP if fault == "deep-error" else DEEP // 10
                self._send(503, b"<Error>" + b"<a>" * depth + b"</a>" * depth + b"</Error>")
            elif fault == "huge-error":
                self._endless(503, b"<Error><Code>SlowDown</Code><Message>")
            elif fault == "redirect":
                self.send_response(307)
                self.send_header("Location", "http://127.0.0.1:9/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif fault == "trickle":
                self._ranged(len(body))
                for byte in body:
                    if endpoint.stopped.wait(0.5) or not self._write(bytes([byte])):
                        return
            elif fault == "stall":
                self._ranged(len(body))
                endpoint.stopped.wait()
            elif fault == "reset":
                self._ranged(len(body))
                self._write(body[: len(body) // 2])
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            elif fault == "short" or (fault == "short-once" and endpoint.gets == 1):
                self._ranged(len(body))
                self._write(body[: len(body) // 2])
            elif fault == "long-length":
                self._ranged(len(body) + 1024)
                self._write(body)
            elif fault == "etag-changes":
                self._ranged(len(body), etag=f'"{endpoint.gets:032x}"')
                self._write(body)
            else:
                self._ranged(len(body))
                self._write(body)

        def _listing(self, prefix: str) -> None:
            if fault == "garbage-listing":
                self._send(200, b"\x00\xffnot <xml at all")
            elif fault == "huge-listing":
                self._endless(200, b"<ListBucketResult><Contents><Key>")
            else:
                key = f"<Contents><Key>{prefix}v1/manifest.json</Key><Size>1</Size></Contents>"
                more = {
                    "endless-listing": "<IsTruncated>true</IsTruncated>"
                    "<NextContinuationToken>again</NextContinuationToken>",
                    "truncated-no-token": "<IsTruncated>true</IsTruncated>",
                }.get(fault, "<IsTruncated>false</IsTruncated>")
                xml = f'<?xml version="1.0"?><ListBucketResult>{key}{more}</ListBucketResult>'
                self._send(200, xml.encode())

        def _ranged(self, length: int, etag: str = ETAG) -> None:
            self.send_response(206)
            self.send_header("Content-Length", str(length))
            self.send_header("ETag", etag)
            self.end_headers()

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self._write(body)

        def _endless(self, status: int, start: bytes) -> None:
            """A body that claims :data:`HUGE_BYTES` and sends them while it is read."""
            self.send_response(status)
            self.send_header("Content-Length", str(HUGE_BYTES))
            self.end_headers()
            chunk = b"x" * (1024 * 1024)
            sent = self._write(start) and len(start)
            deadline = time.monotonic() + endpoint.lifetime
            while sent and sent < HUGE_BYTES and time.monotonic() < deadline:
                piece = chunk[: HUGE_BYTES - sent]
                sent = sent + len(piece) if self._write(piece) else 0

        def _write(self, data: bytes) -> bool:
            """Send ``data``; False once the client went away."""
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:
                return False
            return True

    return Handler
