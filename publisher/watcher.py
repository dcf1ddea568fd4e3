"""Wakes the publisher when a snapshot may have appeared: watchdog events as hints.

Events only shorten the wait; the publisher rescans the directory on every wake-up and at
least every ``rescan_seconds``, so a missed event (network filesystems, queue overflow)
delays a publish instead of losing it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from shared.snapshots import SNAPSHOT_PREFIX


class _DropShutdownRace(logging.Filter):
    """watchdog 7 logs an error when its inotify thread is stopped mid-read; it is harmless."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_DropShutdownRace())


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
        self.observer = PollingObserver(timeout=1.0) if poll else Observer()
        self.observer.schedule(_Hint(self.wake), str(directory), recursive=False)

    def start(self) -> None:
        self.observer.start()

    def stop(self) -> None:
        self.observer.stop()
        self.observer.join(timeout=5)

    def wait(self, timeout: float) -> bool:
        """Block until a hint or ``timeout``; True when a hint came."""
        hinted = self.wake.wait(timeout)
        self.wake.clear()
        return hinted

    def poke(self) -> None:
        """Wake the waiting loop now (used on shutdown)."""
        self.wake.set()
