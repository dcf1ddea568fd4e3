"""An ``sglang.Engine`` in this process as an :class:`~weightcast.client.sglang.engine.SglangEngine`
(the tests' engines, ``up --engine sglang``). The caller built the engine; SGLang's request
types are imported here, lazily, at the first update."""

from __future__ import annotations

from typing import Any

import torch

from weightcast.client.engine import EngineError
from weightcast.client.sglang.engine import PAUSE_MODES


class LocalSglangEngine:
    """An ``sglang.Engine`` (its scheduler runs in a process of its own).

    SGLang's ``Engine`` has no method for pausing or naming the weight version; those go
    through its tokenizer manager, as its HTTP routes do.
    """

    def __init__(self, engine: Any, pause_mode: str = "wait") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.engine = engine
        self.pause_mode = pause_mode

    def _manager(self, call: str, request: Any) -> Any:
        manager = self.engine.tokenizer_manager
        return self.engine.loop.run_until_complete(getattr(manager, call)(request))

    def _check(self, call: str, reply: Any) -> None:
        success, message = reply[0], reply[1]
        if not success:
            raise EngineError(f"{call}: {message}")

    def pause(self) -> None:
        if self.pause_mode != "wait":
            from sglang.srt.managers.io_struct import PauseGenerationReqInput

            self._manager("pause_generation", PauseGenerationReqInput(mode=self.pause_mode))

    def begin_weight_update(self) -> None:
        self._check("begin_weight_update", self.engine.begin_weight_update())

    def update_weights_from_tensor(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self._check("update_weights_from_tensor", self.engine.update_weights_from_tensor(tensors))

    def end_weight_update(self) -> None:
        self._check("end_weight_update", self.engine.end_weight_update())

    def update_weight_version(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        request = UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        self._manager("update_weight_version", request)

    def weight_version(self) -> str:
        return str(self.engine.get_model_info()["weight_version"])

    def resume(self) -> None:
        if self.pause_mode != "wait":
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput

            self._manager("continue_generation", ContinueGenerationReqInput())
