"""Wakes the publisher when a snapshot may have appeared: watchdog events as hints.

Events only shorten the wait; the publisher rescans the directory on every wake-up and at
least every ``rescan_seconds``, so a missed event (network filesystems, queue overflow)
delays a publish instead of losing it. When the kernel's inotify queue overflows, watchdog
only logs it (no event reaches handlers); the watcher listens for that log record and wakes
the loop for a rescan at once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from weightcast.contract.snapshots import SNAPSHOT_PREFIX


class _DropShutdownRace(logging.Filter):
    """watchdog 7 logs an error when its inotify thread is stopped mid-read; it is harmless."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_DropShutdownRace())
_INOTIFY_LOG = logging.getLogger("watchdog.observers.inotify_c")


class _WakeOnOverflow(logging.Handler):
    """watchdog reports lost inotify events only as a log record: treat it as a hint."""

    def __init__(self, wake: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.wake = wake
        self.overflows = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.overflows += 1
            self.wake.set()


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
        self.overflow = _WakeOnOverflow(self.wake)

    def start(self) -> None:
        _INOTIFY_LOG.addHandler(self.overflow)
        self.observer.start()

    def stop(self) -> None:
        _INOTIFY_LOG.removeHandler(self.overflow)
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
