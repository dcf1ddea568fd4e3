"""Wakes the publisher when a snapshot may have appeared: watchdog events as hints.

Events only shorten the wait. The publisher rescans the directory on every wake-up and at
least every ``rescan_seconds``, so an event that never comes (a network filesystem, an
inotify queue overflow: watchdog 7 then drops the pending events and tells no handler) delays
a publish by at most one rescan period instead of losing it. Nothing here depends on
watchdog's log messages or changes its loggers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from weightcast.contract.snapshot_format import SNAPSHOT_PREFIX
from weightcast.runtime.stop import WAIT_SLICE_S, Stop


class _Hint(FileSystemEventHandler):
    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        path = getattr(event, "dest_path", "") or event.src_path
        if Path(str(path)).name.startswith(SNAPSHOT_PREFIX):
            self.wake.set()


class SnapshotWatcher:
    """Watch ``directory`` (not recursively) for ``step-*`` entries appearing."""

    def __init__(self, directory: Path, poll: bool = False) -> None:
        self.directory = directory
        self.wake = threading.Event()
        self.observer: BaseObserver = PollingObserver(timeout=1.0) if poll else Observer()
        self.observer.schedule(_Hint(self.wake), str(directory), recursive=False)

    def start(self) -> None:
        self.observer.start()

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=5)

    def wait(self, timeout: float, stop: Stop | None = None) -> bool:
        """Block until a hint, ``timeout``, or ``stop`` (looked at every
        ``WAIT_SLICE_S``: a signal handler only flags it); True when a hint came."""
        deadline = time.monotonic() + timeout
        hinted = False
        while not hinted and (stop is None or not stop.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            hinted = self.wake.wait(left if stop is None else min(left, WAIT_SLICE_S))
        self.wake.clear()
        return hinted
