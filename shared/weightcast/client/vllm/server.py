"""``vllm serve``'s weight-sync routes over HTTP (they exist with ``VLLM_SERVER_DEV_MODE=1``),
as an :class:`~weightcast.client.vllm.engine.Engine`. vLLM itself is not imported here."""

from __future__ import annotations

from typing import Any

from weightcast.client.engine_server import call_route
from weightcast.client.vllm.engine import engine_error


class VllmServer:
    """``vllm serve``'s weight-sync routes (``VLLM_SERVER_DEV_MODE=1``) over HTTP."""

    def __init__(self, url: str, timeout: float, pause_mode: str = "wait") -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.pause_mode = pause_mode

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON reply. Raises :class:`EngineError` with vLLM's message for
        an error status, :class:`ServerUnavailable` when nothing answers."""
        return call_route(
            self.url, method, route, body, timeout=self.timeout, engine="vllm", error=engine_error
        )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def weight_version(self) -> str:
        return str(self.call("GET", "/weight_info")["weight_version"])

    def pause(self) -> None:
        """``wait`` lets running requests finish (``abort`` ends them); either way the KV and
        prefix caches, computed with the old weights, are cleared."""
        self.call("POST", f"/pause?mode={self.pause_mode}")

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.call("POST", "/finish_weight_update")

    def update_weight_version(self, version: str) -> None:
        self.call("POST", "/update_weight_version", {"new_version": version})

    def resume(self) -> None:
        self.call("POST", "/resume")
