"""The weightcast CLI, torchrun and daemons as real processes, and waiting on them."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.files import REPO


def run_env(redis_url: str, namespace: str, root: Path) -> dict[str, str]:
    """Environment for ``weightcast`` processes: this Redis and namespace, the checkpoint and
    weights directories under ``root``."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WEIGHTCAST_REDIS_URL": redis_url,
        "WEIGHTCAST_NAMESPACE": namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(root / "checkpoints"),
        "WEIGHTCAST_WEIGHTS_DIR": str(root / "weights"),
    }


def with_namespace(env: dict[str, str], root: Path, name: str) -> dict[str, str]:
    """``env`` for a second run beside the test's own: namespace ``<namespace>-<name>`` on the
    same Redis, its directories under ``root / name``; the rest of ``env`` (a PYTHONPATH
    :func:`with_test_modules` set) as it is."""
    namespace = f"{env['WEIGHTCAST_NAMESPACE']}-{name}"
    ours = run_env(env["WEIGHTCAST_REDIS_URL"], namespace, root / name)
    return {**env, **{k: v for k, v in ours.items() if k.startswith("WEIGHTCAST_")}}


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Stop ``process`` with ``signum`` (SIGKILL if it outlives ``timeout``); its exit code."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def clean_env() -> dict[str, str]:
    """This process's environment without WEIGHTCAST_* settings, as a new user's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCAST_")}


def weightcast(*args: str) -> list[str]:
    """argv that runs the weightcast CLI with this interpreter."""
    return [sys.executable, "-m", "weightcast", *args]


def run_weightcast(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        weightcast(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def start_weightcast(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``weightcast <args>`` in the background, appending its output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            weightcast(*args), env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )


def with_test_modules(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``tests/`` first on PYTHONPATH, for processes the tests start that import
    their modules: a trainer loading ``poison_loss:loss``, a vLLM rank script importing
    ``helpers`` (a script's own folder is on its path already)."""
    paths = [str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def config_file(tmp_path: Path, text: str, name: str = "trainer.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    """Poll ``condition`` until it returns something true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)
    return result


def torchrun(nproc: int, *args: str) -> list[str]:
    """argv of ``torchrun --standalone --nproc_per_node <nproc> <args>``.

    ``--standalone`` lets the rendezvous store bind port 0 and tell the workers the port the
    kernel gave it. A port picked beforehand with :func:`free_port` can be taken by another
    process before torchrun binds it (EADDRINUSE at start-up, seen with test suites running
    side by side).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*command, "--nproc_per_node", str(nproc), *args]


def run_torchrun_trainer(
    env: dict[str, str], nproc: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node <nproc> -m weightcast_trainer <args>``."""
    command = torchrun(nproc, "-m", "weightcast_trainer", *args)
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


class OutputLines:
    """A process's output, read line by line by a thread, so that a test can wait for a
    line (an event) with a generous timeout instead of sleeping."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.lines: list[str] = []
        self._seen = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> str:
        """The next line (after the last one matched) that matches the regex ``pattern``."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for index in range(self._seen, len(self.lines)):
                    if compiled.search(self.lines[index]):
                        self._seen = index + 1
                        return self.lines[index]
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r}; output:\n{''.join(self.lines)}"
                self._changed.wait(left)

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)


def healthz(port: int) -> int:
    """The status code of ``/healthz`` on a local port (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def process_resources() -> dict[str, int]:
    """This process's threads, open files (not sockets), sockets and resident memory (after
    a collection, and glibc's freed heap handed back, so that what was freed does not count)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    status = Path("/proc/self/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line[:6] == "VmRSS:")
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    sockets = sum(t.startswith("socket:") for t in targets)
    return {
        "threads": threading.active_count(),
        "files": len(targets) - sockets,
        "sockets": sockets,
        "rss": rss_kb * 1024,
    }
