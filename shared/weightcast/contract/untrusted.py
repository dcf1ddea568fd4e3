"""Parsing JSON that came from outside the process (a file another process wrote, a Redis
value): whatever it holds ends in the caller's error naming it, never in an exception the
caller did not expect (JSON nested deeper than Python's recursion limit raises
``RecursionError``, not ``ValueError``). :class:`Fields` then reads each field of an object
with its type and bounds checked; :class:`HashFields` does the same for a Redis hash, whose
values are all text."""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any

MAX_VALUES = 1 << 21
"""The most JSON values one document may hold, counted from above as its objects, arrays
and commas before anything is parsed. Each value is a Python object of 28 to 72 bytes for as
little as two bytes of input (64 MiB of ``[],`` parse into 1.6 GB, of ``"a",`` into 1 GB);
a manifest or a header holds a few per file, tensor and block (a 335k-block version, far
beyond any model's, about 700k). With it, a document's parse costs at most about 150 MiB
beyond its length."""


def json_object(data: bytes | str, what: str, error: type[Exception]) -> dict[str, Any]:
    """``data`` parsed as a JSON object, or ``error`` saying that ``what`` is not one. Its
    values are counted before anything is parsed (:data:`MAX_VALUES`; brackets and commas
    inside strings count too: an upper bound), so a hostile document costs memory bounded by
    its length, whatever it holds."""
    marks = ("[", "{", ",") if isinstance(data, str) else (b"[", b"{", b",")
    values = 1 + sum(data.count(mark) for mark in marks)  # type: ignore[arg-type]
    if values > MAX_VALUES:
        raise error(
            f"{what} holds up to {values} JSON values, more than the {MAX_VALUES} weightcast "
            "reads in one document; refusing to parse it"
        )
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise error(f"{what} is not a JSON object")
    return value


_MISSING: Any = object()


class Fields:
    """A JSON object from outside, read one typed field at a time: a missing field, a wrong
    type or a value out of bounds is ``error`` naming the field by its path (``where``, e.g.
    ``files[2].blocks``), so that nothing past the parse ever meets a float where it counts
    bytes or a list where it hashes a name. Fields it does not know are refused."""

    def __init__(
        self,
        raw: object,
        where: str,
        error: type[Exception],
        known: Iterable[str],
        record: str = "",
    ) -> None:
        """``record``: the name of the whole object (``the quarantine record``), which every
        message then starts with; ``where`` is the path of ``raw`` inside it."""
        self.where, self.error, self.record = where, error, record
        if not isinstance(raw, dict):
            raise self.fail(f"{where or 'it'} is {shown(raw)}, not an object")
        if unknown := sorted(set(raw) - set(known)):
            raise self.fail(f"{where or 'it'} has unknown fields {shown(unknown)}")
        self.raw: dict[str, Any] = raw

    def fail(self, message: str) -> Exception:
        """The error to raise, saying ``message`` (of the record, when named)."""
        return self.error(f"{self.record}: {message}" if self.record else message)

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def value(self, name: str, default: Any = _MISSING) -> Any:
        """The field as it is (an object for the caller to read with its own Fields)."""
        if name in self.raw:
            return self.raw[name]
        if default is _MISSING:
            raise self.fail(f"lacks {self.path(name)!r}")
        return default

    def integer(self, name: str, minimum: int = 0, default: Any = _MISSING) -> int:
        """An integer ``>= minimum`` (not a float, not a bool)."""
        value = self.value(name, default)
        if not _is_integer(value, minimum):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not an integer >= {minimum}")
        return value

    def number(self, name: str, default: Any = _MISSING) -> float:
        """A finite number, integer or not (not a bool)."""
        value = self.value(name, default)
        try:
            number = float(value) if type(value) in (int, float) else math.nan
        except OverflowError:  # an integer of hundreds of digits
            number = math.nan
        if not math.isfinite(number):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not a finite number")
        return number

    def optional_integer(self, name: str, minimum: int = 0) -> int | None:
        if self.value(name, None) is None:
            return None
        return self.integer(name, minimum)

    def integers(self, name: str, minimum: int = 0) -> list[int]:
        """A list of integers ``>= minimum``."""
        value = self.value(name)
        if not isinstance(value, list) or not all(_is_integer(v, minimum) for v in value):
            raise self.fail(
                f"{self.path(name)} is {shown(value)}, not a list of integers >= {minimum}"
            )
        return value

    def optional_integers(self, name: str, minimum: int = 0) -> list[int] | None:
        if self.value(name, None) is None:
            return None
        return self.integers(name, minimum)

    def text(self, name: str, choices: Iterable[str] | None = None) -> str:
        """A string, one of ``choices`` when given."""
        value = self.value(name)
        if not isinstance(value, str):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not a string")
        if choices is not None and value not in choices:
            raise self.fail(
                f"{self.path(name)} is {value!r}, not one of {', '.join(sorted(choices))}"
            )
        return value

    def optional_text(self, name: str) -> str | None:
        if self.value(name, None) is None:
            return None
        return self.text(name)

    def texts(self, name: str) -> list[str]:
        value = self.value(name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not a list of strings")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.value(name, default)
        if not isinstance(value, bool):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not true or false")
        return value

    def items(self, name: str) -> list[Any]:
        """A list, whose items the caller reads."""
        value = self.value(name)
        if not isinstance(value, list):
            raise self.fail(f"{self.path(name)} is {shown(value)}, not a list")
        return value


def _is_integer(value: object, minimum: int) -> bool:
    return type(value) is int and value >= minimum


def shown(value: object) -> str:
    """``repr(value)``, cut short and shallow: a hostile field may be a list of a million
    items, or nested deep."""
    return reprlib.repr(value)


class HashFields:
    """A Redis hash from outside, read one typed field at a time. Every value is text, so a
    count must be plain decimal digits (``int`` also takes ``1_0``, `` 7 `` and other
    scripts' digits) and a number what ``repr(float)`` writes; a missing field or a value
    that is not its kind is ``error`` naming ``what`` and the field. Fields nobody asks for
    are left alone (a newer writer may add some): :meth:`unread` has them."""

    def __init__(
        self, raw: Mapping[bytes | str, bytes | str], what: str, error: type[Exception]
    ) -> None:
        self.what, self.error = what, error
        self.raw = {_decoded(k): _decoded(v) for k, v in raw.items()}
        self._read: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def text(self, name: str, default: Any = _MISSING) -> str:
        self._read.add(name)
        if name in self.raw:
            return self.raw[name]
        if default is _MISSING:
            raise self.error(f"{self.what} has no {name!r}")
        return default

    def integer(self, name: str, default: Any = _MISSING, signed: bool = False) -> int:
        """Decimal digits (a ``-`` first when ``signed``), at most 19 of them."""
        return self._parse(name, default, "int", _SIGNED if signed else _DIGITS, int)

    def number(self, name: str, default: Any = _MISSING, finite: bool = True) -> float:
        """A decimal number; ``nan`` and ``inf`` too unless ``finite``."""
        return self._parse(name, default, "float", _FINITE if finite else _NUMBER, float)

    def flag(self, name: str, default: bool) -> bool:
        """``1`` or ``0``."""
        return bool(self._parse(name, default, "flag (0 or 1)", _FLAG, int))

    def unread(self) -> dict[str, str]:
        """The fields no call has asked for."""
        return {k: v for k, v in self.raw.items() if k not in self._read}

    def _parse(
        self, name: str, default: Any, kind: str, pattern: re.Pattern[str], make: Any
    ) -> Any:
        text = self.text(name, None if default is not _MISSING else _MISSING)
        if text is None:
            return default
        if not pattern.fullmatch(text):
            raise self.error(f"{self.what}: {name} is {text!r}, not a {kind}")
        return make(text)


_DIGITS = re.compile(r"[0-9]{1,19}")
_SIGNED = re.compile(r"-?[0-9]{1,19}")
_FLAG = re.compile(r"[01]")
_FINITE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_NUMBER = re.compile(rf"{_FINITE.pattern}|-?inf|nan")


def _decoded(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
