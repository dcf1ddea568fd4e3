"""The engines' servers over real HTTP: a loopback server answers as ``vllm serve`` and
SGLang's ``launch_server`` do when an update fails, and the drivers type each answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from weightcast.client.engine import REFUSED, EngineError, ServerUnavailable, VersionRefused
from weightcast.client.engine_server import error_message
from weightcast.client.sglang.server import SglangServer
from weightcast.client.vllm.server import VllmServer

from helpers.servers import free_port, serving

ANSWERS: dict[str, tuple[int, bytes]] = {
    "/vllm-refused": (400, json.dumps({"error": {"message": f"v7: {REFUSED}: tp 2"}}).encode()),
    "/vllm-failed": (500, json.dumps({"error": {"message": "worker died"}}).encode()),
    "/sglang-failed": (400, json.dumps({"message": "shape mismatch"}).encode()),
    "/sglang-unsuccessful": (200, json.dumps({"success": False, "message": "busy"}).encode()),
    "/plain": (502, b"<html>bad gateway</html>"),
    "/ok": (200, json.dumps({"weight_version": "3"}).encode()),
}


class _Answers(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = ANSWERS[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(_Answers) as url:
        yield url


def test_vllm_refusals_are_typed_and_its_failures_carry_its_message(url: str) -> None:
    server = VllmServer(url, timeout=10)
    with pytest.raises(VersionRefused, match="HTTP 400: v7: refused, no parameter touched"):
        server.call("POST", "/vllm-refused")
    with pytest.raises(EngineError, match="HTTP 500: worker died") as failed:
        server.call("POST", "/vllm-failed")
    assert type(failed.value) is EngineError
    assert server.call("GET", "/ok") == {"weight_version": "3"}


def test_sglang_failures_carry_its_message_whether_status_or_success_false(url: str) -> None:
    server = SglangServer(url, timeout=10)
    with pytest.raises(EngineError, match="HTTP 400: shape mismatch"):
        server.call("POST", "/sglang-failed", {})
    with pytest.raises(EngineError, match="/sglang-unsuccessful: busy"):
        server.call("POST", "/sglang-unsuccessful", {})
    with pytest.raises(EngineError, match="HTTP 502: <html>bad gateway</html>"):
        server.call("GET", "/plain")


@pytest.mark.parametrize("server_type", [VllmServer, SglangServer])
def test_a_server_that_does_not_answer_is_unavailable(server_type: type) -> None:
    server = server_type(f"http://127.0.0.1:{free_port()}", timeout=10)
    with pytest.raises(ServerUnavailable, match="unreachable"):
        server.call("POST", "/anything")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"error": {"message": "from vllm"}}', "from vllm"),
        ('{"message": "from sglang"}', "from sglang"),
        ('{"error": "plain error"}', "plain error"),
        ('["a", "list"]', "['a', 'list']"),
        ("not json " * 100, ("not json " * 100)[:500]),
    ],
)
def test_the_message_is_read_out_of_each_engines_error_body(body: str, message: str) -> None:
    assert error_message(body) == message
