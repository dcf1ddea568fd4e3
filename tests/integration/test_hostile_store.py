"""A broken or hostile S3 endpoint (:mod:`helpers.hostile_s3`: missing, negative and lying
lengths, huge and deeply nested error bodies, trickles, stalls, resets, redirects, changing
ETags, garbage listings) never crashes, hangs or bloats the store's client: each call ends
in a typed error (or succeeds, after a retry) within its budget, with bounded memory. Each
case runs in a process of its own, its time and peak memory measured; the cases run at once
(most of each is the interpreter starting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from weightcast.store.s3 import REQUEST_SECONDS

from helpers.files import REPO
from helpers.hostile_s3 import FAULTS, GET_FAULTS, HEAD_FAULTS, LIST_FAULTS, HostileS3
from helpers.processes import with_test_modules

BUDGET_S = 1.0
"""The store's ``retry_seconds`` in these cases."""
LIMIT_S = REQUEST_SECONDS + 2 * BUDGET_S + 15
"""How long a case may take: its last request, started as the budget ends, may take
REQUEST_SECONDS (a stall); the rest is margin for a loaded machine."""
MEMORY_MIB = 64
"""What a case's peak RSS may grow by: a 256 MiB error body is never read whole."""

OUTCOMES = {
    **dict.fromkeys(FAULTS, "StoreUnavailable"),
    "short-once": "ok",  # a short answer is retried like a lost connection
    "etag-changes": "WeightsError",  # another object than the one opened
}


@pytest.fixture(scope="module")
def cases() -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every fault's case, run at once, each against an endpoint of its own."""
    keys = {"AWS_ACCESS_KEY_ID": "weightcast", "AWS_SECRET_ACCESS_KEY": "weightcast"}
    env = with_test_modules({**os.environ, **keys})
    with ExitStack() as stack:
        running = {}
        for fault in FAULTS:
            endpoint = stack.enter_context(HostileS3(fault, lifetime=120))
            op = "list" if fault in LIST_FAULTS else "read"
            args = ["-m", "helpers.hostile_case", endpoint.endpoint_url, op, str(BUDGET_S)]
            running[fault] = subprocess.Popen(
                [sys.executable, *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        done = {}
        for fault, process in running.items():
            out, err = process.communicate(timeout=120)
            done[fault] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
        yield done


@pytest.mark.parametrize("fault", [*HEAD_FAULTS, *GET_FAULTS, *LIST_FAULTS])
def test_every_answer_ends_typed_within_the_budget_in_bounded_memory(
    cases: dict[str, subprocess.CompletedProcess[str]], fault: str
) -> None:
    done = cases[fault]
    assert done.returncode == 0, done.stderr[-3000:]  # no traceback: every error typed
    case = json.loads(done.stdout.splitlines()[-1])
    assert case["outcome"] == OUTCOMES[fault], case
    assert case["seconds"] < LIMIT_S, case
    assert case["mib"] < MEMORY_MIB, case
