"""``weightcast follow``: a reference inference node.

It waits for a newer ``latest``, leases that version, verifies the manifest's checksums,
loads its tensors, records itself in ``{wc}:nodes`` and releases the lease.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any

import redis

from shared.config import Config
from shared.keys import Keys
from shared.logs import get_logger
from shared.weights_client import VersionGone, WeightsClient, WeightsError

log = get_logger("follow")


def run_follow(config: Config) -> int:
    cfg = config.follow
    node_id = cfg.node_id or f"{socket.gethostname()}-{os.getpid()}"
    client = WeightsClient(
        redis.Redis.from_url(config.common.redis_url),
        Keys(config.common.namespace),
        node_id,
        config.common.weights_dir,
        lease_seconds=cfg.lease_seconds,
    )
    stopping = False

    def request_stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    log.info("following", node_id=node_id, weights_dir=str(config.common.weights_dir))
    current = 0
    while not stopping:
        version = client.wait_for_newer(current, timeout=cfg.poll_seconds, poll=cfg.poll_seconds)
        if version is None:
            continue
        start = time.perf_counter()
        try:
            with client.lease(version) as info:
                manifest = client.open(info)
                tensors = client.load(info, manifest)
        except VersionGone:
            log.info(
                "version evicted before it could be leased; trying the latest", version=version
            )
            continue
        except WeightsError as exc:
            log.error("refusing version", version=version, reason=str(exc))
            current = version
            continue
        client.report_loaded(version)
        current = version
        log.info(
            "loaded version",
            version=version,
            step=info.step,
            tensors=len(tensors),
            bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
        )
        if cfg.until_version and version >= cfg.until_version:
            break
    return 0
