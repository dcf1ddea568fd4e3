"""Structured logs: ``event`` names what happened, keyword fields carry the figures.

``text`` format prints ``time level logger: message key=value ...`` for people;
``json`` prints one object per line for log pipelines.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "wc_fields"


class StructuredLogger(logging.LoggerAdapter):
    """A logger whose calls take fields: ``log.info("published", version=3, seconds=0.4)``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k not in _LOGGING_KWARGS}
        kwargs.setdefault("extra", {})[_FIELDS] = fields
        return msg, kwargs


_LOGGING_KWARGS = {"exc_info", "stack_info", "stacklevel", "extra"}


def get_logger(name: str) -> StructuredLogger:
    """The logger ``weightcast.<name>``. A module's ``__name__`` maps into that tree, so that
    one handler and level cover the daemons too: ``weightcast_trainer.snapshot_writer`` logs
    as ``weightcast.trainer.snapshot_writer``."""
    if name.startswith("weightcast_"):
        name = name.replace("_", ".", 1)
    full = name if name.startswith("weightcast.") else f"weightcast.{name}"
    return StructuredLogger(logging.getLogger(full), {})


def _source(record: logging.LogRecord) -> str:
    """Who logged ``record``: weightcast's module, or the library (torchtitan logs through
    the root logger; ``warnings.warn`` arrives as ``py.warnings``)."""
    if record.name == "root":
        return "torchtitan" if "torchtitan" in record.pathname else "root"
    return record.name.removeprefix("weightcast.")


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, _FIELDS, {})
        tail = "".join(f" {k}={_text(v)}" for k, v in fields.items())
        line = f"{stamp} {record.levelname:<5} {_source(record)}: {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": _source(record),
            "event": record.getMessage(),
            **getattr(record, _FIELDS, {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Send weightcast's logs to stderr in ``fmt`` (``text`` or ``json``), and with them the
    warnings and errors of the libraries underneath (torchtitan, torch, ``warnings.warn``),
    which would otherwise print bare or not at all."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    ours = logging.getLogger("weightcast")
    ours.handlers[:] = [handler]
    ours.setLevel(level.upper())
    ours.propagate = False
    libraries = logging.getLogger()
    libraries.handlers[:] = [handler]
    libraries.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    logging.captureWarnings(True)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return json.dumps(text) if " " in text or not text else text
