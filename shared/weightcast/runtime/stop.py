"""A stop request a signal handler can make at any point: a flag, no lock.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
is. ``threading.Event.set()`` takes the event's lock, so a handler that calls it while the
main thread is inside the same event's ``wait()`` (between taking that lock and waiting)
waits for itself forever: the hazard that once hung ``weightcast up``. A daemon's loop
therefore reads a :class:`StopRequest`, which the handler only flags.
"""

from __future__ import annotations

import signal
import time
from typing import Protocol

WAIT_SLICE_S = 0.05
"""How often a :meth:`StopRequest.wait` looks at the flag: a stop's delay at most."""


class Stop(Protocol):
    """What loops and waits read of a stop request: a :class:`StopRequest`, or a
    ``threading.Event`` where another thread (not a signal) stops them."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class StopRequest:
    """SIGINT / SIGTERM as a flag, read as a ``threading.Event`` is (see the module doc)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._requested = False

    def install(self) -> StopRequest:
        """Flag this request on SIGINT and SIGTERM (call from the main thread)."""
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, _signum: int, _frame: object) -> None:
        self._requested = True  # no lock, no I/O, no raise: it may land anywhere

    def set(self) -> None:
        self._requested = True

    def is_set(self) -> bool:
        return self._requested

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the stop is requested or ``timeout`` seconds passed; whether it was."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._requested:
            left = WAIT_SLICE_S if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, WAIT_SLICE_S))
        return True
