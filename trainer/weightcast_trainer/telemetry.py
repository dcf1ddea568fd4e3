"""What the trainer tells operators: the Redis heartbeat, Prometheus gauges and ``/healthz``.

Rank 0 reports for the whole job. The heartbeat hash ``{wc}:trainer:heartbeat`` is a
:class:`~weightcast.contract.heartbeat.Heartbeat`, which ``weightcast status`` prints; its
figures are also Prometheus gauges named ``weightcast_trainer_<field>``. ``/healthz`` answers
503 while Redis is unreachable, while resume checkpoints are failing, or when the loop has
stalled.
"""

from __future__ import annotations

import time

import redis
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.runtime.observability import Health, ObservabilityServer, serve
from weightcast.runtime.retry import Outage

GAUGES = {
    "step": "optimizer steps in the train state",
    "loss": "loss of the last step (token-weighted mean over its micro-batches)",
    "kl": "k3 KL to the reference policy in the last step",
    "entropy": "policy entropy over the trained tokens of the last step",
    "clip_fraction": "fraction of trained tokens whose importance ratio was clipped",
    "grad_norm": "gradient norm of the last step, before clipping",
    "mismatch_kl": "train/inference mismatch of the last step that scored batches: mean k3 "
    "KL(engine || trainer) per trained token, old_logprobs against the trainer's own under "
    "the weights of the version that sampled each batch (any policy lag)",
    "mismatch_max": "largest |old_logprob - trainer logprob| of a trained token in that step",
    "mismatch_version": "the newest version those batches were sampled from",
    "lr": "learning rate the last step used",
    "tokens_per_s": "input tokens per second of the last step (all ranks)",
    "step_seconds": "wall time of the last step",
    "queue_lag": "stream entries not yet delivered to the trainer group",
    "pending": "entries delivered to the trainer group and not yet acknowledged",
    "stale_dropped": "batches dropped as older than max_policy_lag (this process)",
    "dead_lettered": "entries sent to the dead-letter stream (this process)",
    "skipped_steps": "steps not applied because their loss or gradient norm was not finite",
    "already_applied": "re-delivered entries acked because a checkpoint held them",
    "last_policy_lag": "latest version minus the policy_version of the last trained batch",
    "publish_skipped": "snapshots skipped because the previous write was still running",
    "snapshots_written": "snapshots written (this process)",
    "snapshots_skipped_no_space": "snapshots skipped because the checkpoint filesystem was full",
    "snapshot_stage_seconds": "time the loop spent copying weights off the device",
    "snapshot_write_seconds": "background time of the last snapshot write",
    "checkpoint_step": "step of the newest durable resume checkpoint (its entries acked)",
    "checkpoint_seconds": "time the newest durable resume checkpoint took to write",
    "checkpoint_failures": "resume checkpoints that failed (a full disk...); retried later",
}
"""The gauges, each a numeric field of :class:`Heartbeat`, with its help text."""

STALL_S = 120.0
"""``/healthz`` turns unhealthy when the loop has not come round for this long."""


class Telemetry:
    """Heartbeat and metrics of one trainer; only rank 0 writes or serves anything."""

    def __init__(
        self, client: redis.Redis, keys: Keys, port: int, leader: bool, outage: Outage
    ) -> None:
        self.client = client
        self.keys = keys
        self.leader = leader
        self.outage = outage
        self.registry = CollectorRegistry()
        self.gauges = {
            name: Gauge(f"weightcast_trainer_{name}", text, registry=self.registry)
            for name, text in GAUGES.items()
        }
        self.beat = Heartbeat()
        """Every field written so far: the next heartbeat."""
        self.last_beat = 0.0
        self.server: ObservabilityServer | None = (
            serve(port, self.health, lambda: generate_latest(self.registry)) if leader else None
        )

    def update(self, change: Heartbeat) -> None:
        """Take the fields ``change`` sets into the next heartbeat and the gauges."""
        self.beat = self.beat.updated(change)
        for name, value in change.values():
            if name in self.gauges:
                self.gauges[name].set(float(value))

    def heartbeat(self, force: bool = False, every_s: float = 1.0) -> None:
        """Refresh ``{wc}:trainer:heartbeat`` (at most every ``every_s`` unless forced)."""
        now = time.time()
        self.last_beat = now
        if not self.leader or (not force and now - (self.beat.at or 0.0) < every_s):
            return
        self.outage.call(self._beat, "writing the heartbeat")

    def _beat(self) -> None:
        group = next(
            (
                g
                for g in self.client.xinfo_groups(self.keys.batches)
                if g["name"] == TRAINER_GROUP.encode()
            ),
            {},
        )
        self.update(
            Heartbeat(
                queue_lag=int(group.get("lag") or 0),
                pending=int(group.get("pending", 0)),  # XINFO GROUPS counts it too: no XPENDING
                at=time.time(),
            )
        )
        self.client.hset(self.keys.trainer_heartbeat, mapping=self.beat.encode())

    def health(self) -> Health:
        """503 while Redis is unreachable, resume checkpoints fail, or the loop stalls."""
        age = time.time() - self.last_beat
        outage = self.outage
        checkpoint_error = self.beat.last_checkpoint_error or ""
        detail = {
            "step": self.beat.step,
            "loop_age_s": age,
            "redis": f"unreachable: {outage.last_error}" if outage.ongoing else "ok",
            "last_checkpoint_error": checkpoint_error,
        }
        return Health(age < STALL_S and not outage.ongoing and not checkpoint_error, detail)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
