"""The weight update of a vLLM engine run with the ``weightcast`` backend, whatever carries it.

:func:`swap` is the sequence: pause, start, update, finish, set the version vLLM reports,
resume. If a step fails the backend has touched nothing (or says it has), the session is
closed on every rank (see :mod:`.backend` on vLLM's executor) and the engine resumes on its
old version. :class:`Engine` is what it needs of an engine: ``vllm serve`` over HTTP
(:mod:`.server`) or a ``vllm.LLM`` in this process (:mod:`.local_engine`). vLLM passes a
worker's error on as text only; :func:`engine_error` reads it once, into a type.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from weightcast.client.engine import REFUSED, EngineError, VersionRefused

ENGINE_REPLIES: dict[str, type[EngineError]] = {REFUSED: VersionRefused}
"""What the backend writes into its error -> the error's type. vLLM passes a worker's error
on as text only (an HTTP body, a bare ``Exception``); this is the one place that reads it."""


def engine_error(message: str) -> EngineError:
    """The error of a failed engine call, typed by :data:`ENGINE_REPLIES`."""
    kinds = [kind for mark, kind in ENGINE_REPLIES.items() if mark in message]
    return (kinds[0] if kinds else EngineError)(message)


class Engine(Protocol):
    """The weight-sync calls :func:`swap` makes, as vLLM names them."""

    def pause(self) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self) -> None: ...

    def update_weight_version(self, version: str) -> None: ...

    def resume(self) -> None: ...


def swap(engine: Engine, version: int, where: dict[str, Any] | None = None) -> None:
    """Load ``version`` and make the engine report it; raises :class:`EngineError` (the
    engine then serves its old version; nothing was changed if the backend refused).

    ``where`` (``redis_url``, ``namespace``, ``weights_root``, ``node_id``) goes with the
    update, for engines that may have lost their ``init_info`` (a restarted server).
    """
    engine.pause()
    try:
        engine.start_weight_update()
        engine.update_weights({"version": version, **(where or {})})
        engine.finish_weight_update()
        engine.update_weight_version(str(version))
    except EngineError:
        # Ranks that returned from a failed update still hold their session (only the last
        # rank raises); finishing closes them. The last rank's is closed already: it answers
        # with an error, which changes nothing.
        with contextlib.suppress(EngineError):
            engine.finish_weight_update()
        raise
    finally:
        engine.resume()
