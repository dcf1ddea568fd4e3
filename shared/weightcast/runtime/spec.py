"""How one setting is declared: :func:`setting` (its default, meaning, bounds and flag).

Each role declares its own section with it, next to the code that reads it (the trainer's in
``weightcast_trainer.settings``, the publisher's in ``weightcast_publisher.settings``, the
node's in ``weightcast.client.settings``, ``up``'s, ``produce``'s and the rollouts' in
``weightcast.local.settings``, the object store's in ``weightcast.store.settings``);
:mod:`weightcast.runtime.config` composes them into the one configuration and
:mod:`weightcast.runtime.settings` loads, checks, documents and offers it as flags.

A section is a dataclass of :func:`setting` fields with a ``COMMANDS`` class variable: the
commands that read it (and take its flags). This module imports nothing of weightcast's, so
that any role's settings can be declared with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Spec:
    """What a setting declares besides its default (kept in the dataclass field's metadata)."""

    help: str
    flag: str | None = None
    commands: tuple[str, ...] | None = None
    """Commands that take the flag; None means every command of the setting's section."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    pattern_text: str = ""
    """What ``pattern`` asks for, in words, for the error message and the docs."""
    power_of_two: bool = False

    def bounds(self) -> str:
        """The bounds in words, for ``--help`` and the reference page."""
        parts = []
        if self.ge is not None:
            parts.append(f">= {self.ge:g}")
        if self.gt is not None:
            parts.append(f"> {self.gt:g}")
        if self.le is not None:
            parts.append(f"<= {self.le:g}")
        if self.choices:
            parts.append("one of " + ", ".join(self.choices))
        if self.pattern_text:
            parts.append(self.pattern_text)
        if self.power_of_two:
            parts.append("a power of two")
        return "; ".join(parts)


def setting(default: Any = None, help: str = "", *, factory: Any = None, **spec: Any) -> Any:
    """Declare a setting: its default (or ``factory`` for a mutable one), meaning, bounds
    (``ge``, ``gt``, ``le``, ``choices``, ``pattern``/``pattern_text``, ``power_of_two``) and
    flag (``flag``, ``commands``)."""
    metadata = {"spec": Spec(help, **spec)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def metrics_port(serves: str) -> Any:
    """The ``metrics_port`` setting of a daemon that serves ``serves`` (each has its own)."""
    return setting(
        0,
        f"serve {serves} on this port; 0 keeps it off",
        flag="--metrics-port",
        ge=0,
        le=65535,
    )
