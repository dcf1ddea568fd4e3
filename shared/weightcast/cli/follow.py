"""``weightcast follow``: a reference inference node, optionally also the rollout producer.

It waits for a newer ``latest`` and loads it (:class:`~weightcast.client.node.Node`); a version
that must not be loaded is logged and skipped, and the next good one is loaded. With
``--rollout`` it also samples from the version it loaded and pushes scored batches to the
trainer (see :mod:`weightcast.local.rollout`), keeping at most ``rollout.max_pending`` of them
queued. With ``--vllm-url`` it keeps a running ``vllm serve`` on the newest version instead
(:mod:`weightcast.client.vllm.server_node`), with ``--sglang-url`` an SGLang server
(:mod:`weightcast.client.sglang.server_node`).

It rides out Redis outages and a full Redis (``common.redis_retry_seconds``; retries with
capped exponential back-off, then one clear error) and serves ``/healthz`` on
``follow.metrics_port``: 503 while Redis is unreachable or full.
"""

from __future__ import annotations

from weightcast.client.node import Follower, Node
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.observability import Health, serve
from weightcast.runtime.retry import Outage
from weightcast.runtime.stop import StopRequest

log = get_logger("follow")


def run_follow(config: Config) -> int:
    cfg = config.follow
    kinds = [
        flag
        for flag, on in (
            ("--vllm-url", cfg.vllm_url),
            ("--sglang-url", cfg.sglang_url),
            ("--rollout", cfg.rollout),
        )
        if on
    ]
    if len(kinds) > 1:
        raise ConfigError(f"{' and '.join(kinds)} exclude each other: choose one node kind")
    client = WeightsClient(
        config.common.redis_url,
        config.common.weights_location(),
        namespace=config.common.namespace,
        node_id=cfg.node_id,
        lease_seconds=cfg.lease_seconds,
        keep_base=not cfg.vllm_url,  # a plain node keeps its base: the next version by delta
        store_retry_seconds=config.common.store_retry_seconds,
        max_delta_chain=cfg.max_delta_chain,
    )
    client.reader.store.check()
    stop = StopRequest().install()
    node: Follower
    if cfg.vllm_url:
        from weightcast.client.vllm.server_node import server_node

        node = server_node(config, client)
    elif cfg.sglang_url:
        from weightcast.client.sglang.server_node import sglang_server_node

        node = sglang_server_node(config, client)
    else:
        node = plain = Node(client, report_every=cfg.poll_seconds)
    outage = Outage(budget=config.common.redis_retry_seconds)
    server = serve(cfg.metrics_port, lambda: node_health(node, outage))
    log.info(
        "following",
        node_id=client.node_id,
        weights=client.reader.store.label,
        vllm_url=cfg.vllm_url or None,
        sglang_url=cfg.sglang_url or None,
        healthz=server.port if server else "off",
    )
    try:
        if cfg.rollout:  # a plain node: --rollout excludes the engine URLs
            from weightcast.local.rollout import run_rollout_node

            return run_rollout_node(config, plain, stop, outage)
        while not stop.is_set():
            followed = outage.attempt(
                lambda: node.step(cfg.poll_seconds, stop), "following", stop.wait
            )
            if followed and cfg.until_version and node.current >= cfg.until_version:
                break
        return 0
    finally:
        if server is not None:
            server.close()
        node.close()
        client.close()


def node_health(node: Follower, outage: Outage) -> Health:
    """``/healthz``: 200 while Redis answers, 503 while it is unreachable or full."""
    detail = {"node_id": node.client.node_id, "version": node.current, **outage.detail()}
    return Health(not outage.ongoing, detail)
