"""One library call against a hostile endpoint, in a process of its own so that the test can
measure it alone (run with ``tests`` on PYTHONPATH)::

    python -m helpers.hostile_case http://127.0.0.1:PORT read 2

Prints one JSON line: the typed error the call ended in (``ok`` for none, ``wrong bytes``
for bytes that are not the object's), its message, how long it took and how much the
process's peak RSS grew during it. Anything else (a ``KeyError`` from below) escapes as a
traceback and exit status 1, as it would from ``weightcast follow``.
"""

from __future__ import annotations

import json
import resource
import sys
import time

from weightcast.contract.errors import WeightcastError
from weightcast.store.s3 import S3Location, S3Store

from helpers.hostile_s3 import OBJECT


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    endpoint, op, retry_seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    url = f"s3://bucket/run?endpoint_url={endpoint}&addressing_style=path&region=us-east-1"
    store = S3Store(S3Location.parse(url), concurrency=4, retry_seconds=retry_seconds)
    before, started = peak_rss_kib(), time.monotonic()
    outcome, message = "ok", ""
    try:
        if op == "read":
            with store.open_version("v1") as version, version.open("model", len(OBJECT)) as f:
                if f.read_at(0, len(OBJECT)) != OBJECT:
                    outcome = "wrong bytes"
        else:
            store.version_names()
    except WeightcastError as exc:
        outcome, message = type(exc).__name__, str(exc)
    seconds = time.monotonic() - started
    growth = (peak_rss_kib() - before) / 1024
    print(json.dumps({"outcome": outcome, "message": message, "seconds": seconds, "mib": growth}))
    store.close()


if __name__ == "__main__":
    main()
