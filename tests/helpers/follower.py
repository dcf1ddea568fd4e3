"""``weightcast follow`` driving an engine's server, as a process (the real-engine tiers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping

from helpers.files import REPO


class Follower:
    """``weightcast follow --vllm-url`` (or ``flag``: ``--sglang-url``) as a process (``env``:
    its ``WEIGHTCAST_*`` settings); its log lines collected as they come. ``stop_at`` SIGSTOPs
    it the moment a line matches (from the reading thread: no delay)."""

    def __init__(
        self, env: Mapping[str, str], url: str, node_id: str, flag: str = "--vllm-url"
    ) -> None:
        argv = [sys.executable, "-m", "weightcast", "follow", flag, url]
        argv += ["--node-id", node_id, "--poll-seconds", "0.5", "--lease-seconds", "3"]
        self.process = subprocess.Popen(
            [*argv, "--log-level", "DEBUG"],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.stop_at: re.Pattern[str] | None = None
        self.stopped = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if self.stop_at and not self.stopped.is_set() and self.stop_at.search(line):
                self.process.send_signal(signal.SIGSTOP)
                self.stopped.set()
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)
