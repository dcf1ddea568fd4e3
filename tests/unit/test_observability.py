"""The /metrics and /healthz server every daemon uses, over a real socket."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter, generate_latest

from weightcast.runtime.observability import Health, serve


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_metrics_and_health_are_served_and_reflect_state() -> None:
    registry = CollectorRegistry()
    published = Counter("weightcast_test_published", "versions", registry=registry)
    state = {"ok": True}
    server = serve(
        -1,
        lambda: Health(state["ok"], {"step": 3}),
        lambda: generate_latest(registry),
        host="127.0.0.1",
    )
    assert server is not None
    try:
        published.inc(2)
        code, body = _get(server.port, "/metrics")
        assert code == 200
        assert "weightcast_test_published_total 2.0" in body.decode()
        code, body = _get(server.port, "/healthz")
        assert (code, json.loads(body)) == (200, {"ok": True, "step": 3})
        state["ok"] = False
        code, body = _get(server.port, "/healthz")
        assert code == 503 and json.loads(body)["ok"] is False
        assert _get(server.port, "/nope")[0] == 404
    finally:
        server.close()


def test_a_failing_health_check_reports_unhealthy_with_the_error() -> None:
    def broken() -> Health:
        raise ConnectionError("redis down")

    server = serve(-1, broken, host="127.0.0.1")
    assert server is not None
    try:
        code, body = _get(server.port, "/healthz")
        assert code == 503
        assert json.loads(body) == {"ok": False, "error": "ConnectionError: redis down"}
    finally:
        server.close()


def test_port_zero_keeps_the_server_off() -> None:
    assert serve(0, lambda: Health(True)) is None
