"""What a call holds in memory, as tracemalloc sees it (Python objects and numpy arrays)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable


def peak_traced(read: Callable[[], object]) -> int:
    """The most bytes Python and numpy held at once above the start, during ``read``."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        start, _ = tracemalloc.get_traced_memory()
        read()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
