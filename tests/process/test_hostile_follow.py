"""``weightcast follow`` against a hostile S3 endpoint (:mod:`helpers.hostile_s3`): the
version registered is real (published to SeaweedFS), but every answer about its objects is
broken. The node never exits on one: it logs the store unavailable, keeps what it holds and
tries again, its memory flat, until it is stopped (exit 0)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import pytest
import redis

from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server
from weightcast.store.s3 import REQUEST_SECONDS

from helpers.hostile_s3 import HostileS3
from helpers.processes import start_weightcast, stop, wait_for
from helpers.s3 import s3_process_env, store_settings
from helpers.versions import Deployment

pytestmark = pytest.mark.slow

FAULTS = ("no-length", "deep-error", "huge-error", "trickle")
"""A crash (KeyError, RecursionError), a bloat (256 MiB error bodies) and a hang before."""
UNAVAILABLE = "the object store is unavailable; serving the version held"
MEMORY_MIB = 64


def memory_kib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of process ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def logged(log: Path, text: str, times: int, process: subprocess.Popen[bytes]) -> bool:
    """Whether ``text`` is in ``log`` ``times`` times, or ``process`` has exited."""
    return log.read_text().count(text) >= times or process.poll() is not None


def test_follow_rides_out_every_hostile_answer_in_flat_memory_and_stops_cleanly(
    tmp_path: Path,
    cli_env: dict[str, str],
    s3_env: dict[str, str],
    s3_server: S3Server,
    s3_bucket: str,
    redis_server: RedisServer,
    client: redis.Redis,
    keys: Keys,
) -> None:
    """``s3_env``: the publisher's credentials here; the nodes' come by ``s3_process_env``."""
    settings = store_settings(s3_server, s3_bucket)
    Deployment(client, keys, tmp_path, redis_server.url, store=settings).publish()
    with ExitStack() as stack:
        nodes: dict[str, tuple[subprocess.Popen[bytes], Path, int]] = {}
        for fault in FAULTS:
            endpoint = stack.enter_context(HostileS3(fault, lifetime=180))
            env = s3_process_env(s3_server, cli_env)
            env.update(
                WEIGHTCAST_WEIGHTS_URL=f"s3://{s3_bucket}/run",
                WEIGHTCAST_S3_ENDPOINT_URL=endpoint.endpoint_url,
                WEIGHTCAST_S3_ADDRESSING_STYLE="path",
                WEIGHTCAST_STORE_RETRY_SECONDS="1",
                WEIGHTCAST_WEIGHTS_DIR=str(tmp_path / f"node-{fault}"),
            )
            log = tmp_path / f"follow-{fault}.log"
            args = ("follow", "--node-id", fault, "--poll-seconds", "0.2")
            process = start_weightcast(env, log, *args)
            stack.callback(stop, process, signal.SIGKILL, 5)
            nodes[fault] = (process, log, 0)
        for fault, (process, log, _) in nodes.items():
            wait_for(partial(logged, log, "following", 1, process), 120, f"{fault}: following")
            nodes[fault] = (process, log, memory_kib(process.pid, "VmRSS"))
        for fault, (process, log, _) in nodes.items():
            tries = partial(logged, log, UNAVAILABLE, 2, process)
            wait_for(tries, 60 + 2 * REQUEST_SECONDS, f"{fault}: two tries of the version")
        time.sleep(1)
        for fault, (process, log, before) in nodes.items():
            text = log.read_text()
            assert process.poll() is None, f"{fault}: follow exited:\n{text[-3000:]}"
            growth = (memory_kib(process.pid, "VmHWM") - before) / 1024
            assert growth < MEMORY_MIB, f"{fault}: peak RSS grew by {growth:.0f} MiB"
            assert stop(process, timeout=30) == 0, f"{fault}:\n{log.read_text()[-3000:]}"
            assert "Traceback" not in log.read_text()
