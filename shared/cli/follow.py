"""``weightcast follow``: a reference inference node, optionally also the rollout producer.

It waits for a newer ``latest`` and loads it (:class:`~weightcast.client.node.Node`). With
``--rollout`` it also samples from the version it loaded and pushes scored batches to the
trainer (see :mod:`weightcast.local.rollout`), keeping at most ``rollout.max_pending`` of them
queued. With ``--vllm-url`` it keeps a running ``vllm serve`` on the newest version instead
(:mod:`weightcast.client.vllm.driver`).
"""

from __future__ import annotations

import signal
from typing import Any

from weightcast.client.node import Node
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger

log = get_logger("follow")


def run_follow(config: Config) -> int:
    cfg = config.follow
    if cfg.vllm_url and cfg.rollout:
        raise ConfigError("--vllm-url and --rollout exclude each other: choose one node kind")
    client = WeightsClient(
        config.common.redis_url,
        config.common.namespace,
        cfg.node_id,
        config.common.weights_dir,
        lease_seconds=cfg.lease_seconds,
    )
    stopping = False

    def request_stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if cfg.vllm_url:
        from weightcast.client.vllm.driver import follow_server

        return follow_server(config, client, lambda: stopping)
    log.info("following", node_id=client.node_id, weights_dir=str(config.common.weights_dir))
    node = Node(client, report_every=cfg.poll_seconds)
    if cfg.rollout:
        from weightcast.local.rollout import run_rollout_node

        return run_rollout_node(config, node, lambda: stopping)
    while not stopping:
        version = client.wait_for_newer(node.seen, timeout=cfg.poll_seconds, poll=cfg.poll_seconds)
        if version is None:
            node.report()
            continue
        node.load(version)
        if cfg.until_version and node.current >= cfg.until_version:
            break
    return 0
