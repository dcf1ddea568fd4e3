"""A stop request made by a signal handler, wherever the signal lands: the handler of
:class:`StopRequest` never blocks, where ``threading.Event.set()`` waits forever when the
signal lands inside the same event's ``wait()``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from weightcast.runtime.stop import StopRequest

SIGNAL_AT_EVERY_LINE = textwrap.dedent(
    """
    import signal, sys, threading

    kind = sys.argv[1]
    if kind == "event":  # what follow and the publisher installed before
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    else:
        from weightcast.runtime.stop import StopRequest
        stop = StopRequest().install()
    handler = signal.getsignal(signal.SIGTERM)
    landed = 0

    def trace(frame, event, arg):
        # Run the handler as a signal would, at each line executed inside wait().
        global landed
        if event == "line":
            landed += 1
            sys.settrace(None)  # the handler itself runs untraced
            handler(signal.SIGTERM, frame)
            sys.settrace(trace)
        return trace

    for _ in range(3):
        sys.settrace(trace)
        stop.wait(0.01)
        sys.settrace(None)
    print("stopped", stop.is_set(), landed)
    """
)


def run(kind: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_EVERY_LINE, kind],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_stop_requested_by_a_signal_at_any_line_of_the_wait_never_blocks() -> None:
    done = run("request", timeout=120)
    assert done.returncode == 0, done.stderr
    stopped, is_set, landed = done.stdout.split()
    assert (stopped, is_set) == ("stopped", "True") and int(landed) > 0


def test_the_same_signal_inside_an_events_wait_hangs_the_process() -> None:
    """The hazard the flag avoids, shown by the harness above: it is no stand-in."""
    with pytest.raises(subprocess.TimeoutExpired):
        run("event", timeout=5)


def test_a_stop_request_waits_out_its_timeout_or_returns_once_set() -> None:
    stop = StopRequest()
    assert stop.wait(0.01) is False and not stop.is_set()
    stop.set()
    assert stop.wait(10) is True and stop.wait() is True
