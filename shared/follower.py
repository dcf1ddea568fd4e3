"""``weightcast follow``: a reference inference node, optionally also the rollout producer.

It waits for a newer ``latest``, leases that version, verifies the manifest's checksums,
loads its tensors, records itself in ``{wc}:nodes`` and releases the lease. With
``--rollout`` it also samples from the version it loaded and pushes scored batches to the
trainer (see :mod:`shared.rollout`), keeping at most ``rollout.max_pending`` of them queued.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from shared.config import Config
from shared.logs import get_logger
from shared.producer import BatchProducer
from shared.rollout import ModelPolicy, Policy, Rollout, RolloutLoop
from shared.weights_client import VersionGone, WeightsClient, WeightsError

log = get_logger("follow")

_IDLE_S = 0.05
"""How long the rollout loop sleeps when the queue is full (it rechecks versions meanwhile)."""


class Node:
    """Loads each new version once: lease, verify, read, report."""

    def __init__(self, client: WeightsClient, want_model: bool, report_every: float) -> None:
        self.client = client
        self.want_model = want_model
        self.report_every = report_every
        self.current = 0
        """The version this node serves (0: none yet)."""
        self.seen = 0
        """The newest version tried, loaded or refused: no need to try it again."""
        self.reported_at = 0.0

    def report(self) -> None:
        """Re-report the version served, so ``weightcast status`` sees the node is alive."""
        if self.current and time.monotonic() - self.reported_at >= self.report_every:
            self.client.report_loaded(self.current)
            self.reported_at = time.monotonic()

    def load(self, version: int) -> ModelPolicy | None:
        """Load ``version``; the model when asked for one. None when it could not be used."""
        start = time.perf_counter()
        try:
            with self.client.lease(version) as info:
                tensors = self.client.load(info)
                config = self.client.config(info)
        except VersionGone:
            log.info(
                "version evicted before it could be leased; trying the latest", version=version
            )
            return None
        except WeightsError as exc:
            log.error("refusing version", version=version, reason=str(exc))
            self.seen = version
            return None
        policy = (
            ModelPolicy.from_published(version, config, tensors, info.tp)
            if self.want_model
            else None
        )
        self.client.report_loaded(version)
        self.current = self.seen = version
        self.reported_at = time.monotonic()
        log.info(
            "loaded version",
            version=version,
            step=info.step,
            tensors=len(tensors),
            bytes=info.bytes,
            seconds=round(time.perf_counter() - start, 3),
        )
        return policy


def run_follow(config: Config) -> int:
    cfg = config.follow
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
    log.info("following", node_id=client.node_id, weights_dir=str(config.common.weights_dir))
    node = Node(client, want_model=cfg.rollout, report_every=cfg.poll_seconds)
    if cfg.rollout:
        return _run_rollout(config, node, lambda: stopping)
    while not stopping:
        version = client.wait_for_newer(node.seen, timeout=cfg.poll_seconds, poll=cfg.poll_seconds)
        if version is None:
            node.report()
            continue
        node.load(version)
        if cfg.until_version and node.current >= cfg.until_version:
            break
    return 0


def _run_rollout(config: Config, node: Node, stopping: Any) -> int:
    """Load each new version and keep the trainer fed with rollouts from the newest one."""
    cfg = config.rollout
    producer = BatchProducer(
        config.common.redis_url,
        config.common.namespace,
        name=node.client.node_id,
        max_pending=cfg.max_pending,
        timeout=cfg.timeout,
    )

    def refresh(policy: Policy) -> Policy | None:
        latest = node.client.latest()
        return node.load(latest) if latest > max(policy.version, node.seen) else None

    def push(rollout: Rollout, version: int) -> str:
        return producer.push(rollout.tensors, version, reward=rollout.reward)

    loop = RolloutLoop(cfg, refresh, producer.has_room, push)
    log.info("producing rollouts", max_pending=cfg.max_pending, group_size=cfg.group_size)
    idle_since = time.monotonic()
    while not stopping():
        node.report()
        if loop.step():
            idle_since = time.monotonic()
            continue
        if time.monotonic() - idle_since > cfg.timeout:
            raise producer.timed_out(producer.undelivered())
        time.sleep(_IDLE_S)
    producer.close()
    return 0
