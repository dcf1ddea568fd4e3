"""One JSON request to an engine's server (``vllm serve``, SGLang's ``launch_server``), its
failures typed as :mod:`weightcast.client.engine` types them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from weightcast.client.engine import EngineError, ServerUnavailable
from weightcast.runtime.logs import get_logger


def call_route(
    url: str,
    method: str,
    route: str,
    body: dict[str, Any] | None,
    *,
    timeout: float,
    engine: str,
    error: Callable[[str], EngineError] = EngineError,
) -> Any:
    """One request to ``url + route``; the JSON reply. ``error`` (the engine's message) for an
    error status, :class:`ServerUnavailable` when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + route, data, {"Content-Type": "application/json"}, method=method
    )
    get_logger(engine).debug(f"{engine} request", route=route)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as exc:
        message = error_message(exc.read().decode(errors="replace"))
        raise error(f"{method} {route}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerUnavailable(f"{method} {route}: {url} unreachable: {reason}") from None


def error_message(text: str) -> str:
    """The engine's message out of an error reply's body: vLLM's ``{"error": {"message":
    ...}}``, SGLang's ``{"message": ...}`` or ``{"error": ...}``, or the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    if not isinstance(body, dict):
        return str(body)
    detail = body.get("message", body.get("error", body))
    return str(detail.get("message", detail) if isinstance(detail, dict) else detail)
