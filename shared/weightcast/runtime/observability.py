"""Prometheus ``/metrics`` and ``/healthz`` for a process, on one small HTTP server.

Each daemon owns its metrics (a ``prometheus_client`` registry, rendered by the daemon) and a
health callable; :func:`serve` exposes both on a port (0 keeps it off, as in tests that do
not ask for it). ``/healthz`` answers 200 with the callable's JSON when healthy, 503 when not,
so a compose or Kubernetes healthcheck can curl it. This module needs no prometheus_client:
a client-side process (``weightcast follow``) serves ``/healthz`` alone.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Health:
    """What ``/healthz`` reports: ``ok`` decides the status code, ``detail`` the body."""

    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)


HealthCheck = Callable[[], Health]
MetricsText = Callable[[], bytes]
"""Renders the metrics in Prometheus' text format (``prometheus_client.generate_latest``)."""

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class ObservabilityServer:
    """A background HTTP server for ``/metrics`` and ``/healthz``; stop it with :meth:`close`."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="weightcast-metrics", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(
    port: int, health: HealthCheck, metrics: MetricsText | None = None, host: str = "0.0.0.0"
) -> ObservabilityServer | None:
    """Serve ``health`` (and ``metrics``, when given) on ``host:port``; ``port`` 0 means off.

    Pass ``port=-1`` to bind a free port (tests); read it back from ``.port``.
    """
    if port == 0:
        return None
    handler = _handler_for(health, metrics)
    server = ThreadingHTTPServer((host, max(port, 0)), handler)
    server.daemon_threads = True
    return ObservabilityServer(server)


def _handler_for(health: HealthCheck, metrics: MetricsText | None) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and metrics is not None:
                self._reply(200, PROMETHEUS_TEXT, metrics())
            elif path == "/healthz":
                try:
                    state = health()
                except Exception as exc:  # a failing check is an unhealthy daemon, not a 500
                    state = Health(False, {"error": f"{type(exc).__name__}: {exc}"})
                body = json.dumps({"ok": state.ok, **state.detail}, default=str).encode()
                self._reply(200 if state.ok else 503, "application/json", body)
            else:
                known = "/metrics or /healthz" if metrics is not None else "/healthz"
                self._reply(404, "text/plain", f"try {known}\n".encode())

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes every few seconds would drown the daemon's own logs."""

    return Handler
