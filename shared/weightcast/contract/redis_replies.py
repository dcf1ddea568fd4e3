"""Redis' error replies as weightcast types: the one place that reads their text.

Redis names an error by the first word of its reply (``NOPERM``, ``OOM``, ``BUSYGROUP``...).
redis-py turns some of those codes into its own exception types and drops the code from the
text; the others stay a bare ``ResponseError`` whose text starts with the code. :func:`refusal`
reads the code either way and looks it up in :data:`REPLY_CODES`; every caller decides on the
type it returns, never on the text.
"""

from __future__ import annotations

import redis

from weightcast.contract.errors import (
    RedisAccessDenied,
    RedisFull,
    RedisGroupExists,
    WeightcastError,
)

REPLY_CODES: dict[str, type[WeightcastError]] = {
    "NOAUTH": RedisAccessDenied,  # no password given
    "WRONGPASS": RedisAccessDenied,
    "NOPERM": RedisAccessDenied,  # an ACL user without the command or key
    "OOM": RedisFull,  # maxmemory reached under noeviction: writes refused
    "BUSYGROUP": RedisGroupExists,
}
"""An error reply's code -> what it means to weightcast."""

_REDIS_PY_CODES: dict[type[redis.RedisError], str] = {
    redis.AuthenticationError: "NOAUTH",  # NOAUTH, WRONGPASS, "ERR invalid password"
    redis.exceptions.NoPermissionError: "NOPERM",
    redis.exceptions.OutOfMemoryError: "OOM",
}
"""redis-py's exception types that stand for a code it stripped from the text."""


def reply_code(exc: BaseException) -> str:
    """The code of Redis' error reply behind ``exc`` ("" when it is no error reply)."""
    for kind, code in _REDIS_PY_CODES.items():
        if isinstance(exc, kind):
            return code
    if isinstance(exc, redis.ResponseError):
        return str(exc).split(" ", 1)[0]
    return ""


def refusal(exc: BaseException) -> type[WeightcastError] | None:
    """What Redis' refusal ``exc`` means to weightcast (:data:`REPLY_CODES`); None when it
    is none of those (an outage, or an error to let through)."""
    return REPLY_CODES.get(reply_code(exc))
