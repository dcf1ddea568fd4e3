"""A ``python -m sglang.launch_server`` over HTTP as an
:class:`~weightcast.client.sglang.engine.SglangEngine`.

SGLang's ``/update_weights_from_tensor`` takes the tensors as SGLang's own
``MultiprocessingSerializer`` pickles them: handles to shared memory, not the bytes. So the
driver must run on the server's host (its tensors' shared memory is what the server maps),
and it needs SGLang installed (imported here lazily, at the first update). The tensors go into
shared memory by file name (torch's ``file_system`` sharing strategy): a descriptor passed
through multiprocessing's resource sharer authenticates with the sending process's key, which
an unrelated server process does not hold.
"""

from __future__ import annotations

from typing import Any

import torch

from weightcast.client.engine import EngineError
from weightcast.client.engine_server import call_route
from weightcast.client.sglang.engine import PAUSE_MODES

NO_OPEN_SESSION = "no weight-update session is open"
"""SGLang's answer (0.5.23) to ``/end_weight_update`` when no session is open."""


class SglangServer:
    """An SGLang server's update routes (``/begin_weight_update``, ...) over HTTP."""

    def __init__(self, url: str, timeout: float, pause_mode: str = "wait") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.pause_mode = pause_mode

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON reply. :class:`EngineError` with SGLang's message for an
        error status or ``"success": false``, :class:`ServerUnavailable` when nothing
        answers."""
        answer = call_route(self.url, method, route, body, timeout=self.timeout, engine="sglang")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"{method} {route}: {answer.get('message')}")
        return answer

    def model_info(self) -> dict[str, Any]:
        return dict(self.call("GET", "/model_info"))

    def weight_version(self) -> str:
        return str(self.model_info()["weight_version"])

    def pause(self) -> None:
        if self.pause_mode != "wait":
            self.call("POST", "/pause_generation", {"mode": self.pause_mode})

    def begin_weight_update(self) -> None:
        self.call("POST", "/begin_weight_update", {})

    def update_weights_from_tensor(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.utils.common import MultiprocessingSerializer

        torch.multiprocessing.set_sharing_strategy("file_system")
        payload = MultiprocessingSerializer.serialize(tensors, output_str=True)
        ranks = int(self.call("GET", "/get_server_info").get("tp_size", 1))
        body = {"serialized_named_tensors": [payload] * ranks, "flush_cache": True}
        self.call("POST", "/update_weights_from_tensor", body)

    def end_weight_update(self) -> None:
        self.call("POST", "/end_weight_update", {})

    def update_weight_version(self, version: str) -> None:
        body = {"new_version": version, "abort_all_requests": False}
        self.call("POST", "/update_weight_version", body)

    def end_leftover_update(self) -> bool:
        """End what a node stopped mid-update left: its weight-update session (SGLang opens no
        other while one is open) and its pause. Whether a session was open: the weights may
        then be partly those of the version it was loading."""
        try:
            self.end_weight_update()
        except EngineError as exc:
            if NO_OPEN_SESSION not in str(exc):
                raise
            left_open = False
        else:
            left_open = True
        self.call("POST", "/continue_generation", {})  # a no-op unless generation is paused
        return left_open

    def resume(self) -> None:
        if self.pause_mode != "wait":
            self.call("POST", "/continue_generation", {})
