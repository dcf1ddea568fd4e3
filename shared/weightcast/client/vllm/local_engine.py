"""A ``vllm.LLM`` in this process as an :class:`~weightcast.client.vllm.engine.Engine`
(``up --engine vllm``, the tests' engines). vLLM itself is not imported here: the caller
built the ``LLM``."""

from __future__ import annotations

from typing import Any

from weightcast.client.vllm.engine import engine_error


class LocalEngine:
    """A ``vllm.LLM`` in this process, run with ``WeightTransferConfig(backend="weightcast")``.

    ``LLM`` calls block until done, so there is nothing in flight to pause; the prefix cache
    (KV computed with the old weights) is reset on resume.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _run(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.llm, name)(*args)
        except Exception as exc:  # vLLM reports a worker's failure as a bare Exception
            raise engine_error(f"{name}: {exc}") from exc

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run("init_weight_transfer_engine", {"init_info": init_info})

    def weight_version(self) -> str:
        return str(self._run("get_weight_version"))

    def pause(self) -> None:
        """Nothing runs between two ``LLM`` calls."""

    def start_weight_update(self) -> None:
        self._run("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run("update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._run("finish_weight_update")

    def update_weight_version(self, version: str) -> None:
        self._run("update_weight_version", version)

    def resume(self) -> None:
        self._run("reset_prefix_cache")
