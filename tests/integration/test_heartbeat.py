"""The trainer's heartbeat as its telemetry writes it to a real Redis: typed changes in,
the flat text fields of the wire contract out, read back through the contract's type."""

from __future__ import annotations

import time

import redis

from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.keys import Keys
from weightcast.contract.streams import ensure_group
from weightcast.runtime.retry import Outage
from weightcast_trainer.telemetry import Telemetry


def test_typed_changes_make_the_heartbeat_and_the_gauges(client: redis.Redis, keys: Keys) -> None:
    ensure_group(client, keys)
    telemetry = Telemetry(client, keys, port=0, leader=True, outage=Outage())
    telemetry.update(Heartbeat(step=0, run_id="r1", consumer="c1", last_checkpoint_error=""))
    telemetry.update(Heartbeat(step=3, loss=0.25, last_policy_lag=-1, snapshot_write_seconds=2.0))
    telemetry.heartbeat(force=True)
    raw = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer_heartbeat).items()}
    assert raw == {
        "step": "3",
        "run_id": "r1",
        "consumer": "c1",
        "last_checkpoint_error": "",
        "loss": "0.25",
        "last_policy_lag": "-1",
        "snapshot_write_seconds": "2.0",
        "queue_lag": "0",
        "pending": "0",
        "at": raw["at"],
    }
    beat = Heartbeat.parse(client.hgetall(keys.trainer_heartbeat))
    assert beat == telemetry.beat and abs(time.time() - (beat.at or 0)) < 60
    assert telemetry.registry.get_sample_value("weightcast_trainer_loss") == 0.25
    assert telemetry.health().detail["step"] == 3
