"""Parsing JSON that came from outside the process (a file another process wrote, a Redis
value): whatever it holds ends in the caller's error naming it, never in an exception the
caller did not expect (JSON nested deeper than Python's recursion limit raises
``RecursionError``, not ``ValueError``)."""

from __future__ import annotations

import json
from typing import Any


def json_object(data: bytes | str, what: str, error: type[Exception]) -> dict[str, Any]:
    """``data`` parsed as a JSON object, or ``error`` saying that ``what`` is not one."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{what} is not a JSON object")
    return value
