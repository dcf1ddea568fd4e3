"""The Redis records with one typed home each in the contract (the registry entry, the
events, the quarantine record, the trainer's heartbeat): what the writer encodes is what
readers parse, byte for byte as the wire contract says, and what no writer writes is refused
with the reason."""

from __future__ import annotations

import json
import re

import pytest

from weightcast.contract.errors import RecordError, WeightsError
from weightcast.contract.events import Evicted, Published, parse_event
from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.quarantine import QuarantineRecord
from weightcast.contract.untrusted import HashFields
from weightcast.contract.version_info import VersionInfo, dir_version, version_dir_name

ENTRY = VersionInfo(
    version=7, path="v7", step=12, layout="vllm-fused", tp=2, dtype="bfloat16", bytes=4096,
    manifest_sha256="ab" * 32, run_id="run-1", created_at=1700000001.25,
    delta_from=6, delta_bytes=100, snapshot_id="snap-12", snapshot_created_at=1700000000.5,
    per_rank_files=True, hf_path="v7/hf",
)  # fmt: skip


def test_the_registry_entry_is_the_publishers_hash_and_reads_back() -> None:
    fields = ENTRY.as_fields()
    assert fields == {
        "path": "v7",
        "step": "12",
        "layout": "vllm-fused",
        "tp": "2",
        "dtype": "bfloat16",
        "bytes": "4096",
        "manifest_sha256": "ab" * 32,
        "run_id": "run-1",
        "snapshot_id": "snap-12",
        "snapshot_created_at": "1700000000.5",
        "per_rank_files": "1",
        "delta_from": "6",
        "delta_bytes": "100",
        "hf_path": "v7/hf",
        "created_at": "1700000001.25",
    }
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    assert VersionInfo.from_fields(7, raw) == ENTRY
    plain = VersionInfo(
        version=7, path="v7", step=12, layout="hf", tp=1, dtype="bfloat16", bytes=1,
        manifest_sha256="ab" * 32, run_id="r", created_at=2.0,
    )  # fmt: skip
    assert "hf_path" not in plain.as_fields()  # only a version with an HF copy has one
    assert VersionInfo.from_fields(7, plain.as_fields()) == plain


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("per_rank_files", "True", "per_rank_files is 'True', not a flag"),
        ("snapshot_created_at", "soon", "snapshot_created_at is 'soon', not a float"),
        ("created_at", "1_0", "created_at is '1_0', not a float"),
        ("created_at", "inf", "created_at is 'inf', not a float"),
        ("step", "+3", "step is '+3', not a int"),
        ("tp", "2" * 20, f"tp is '{'2' * 20}', not a int"),
    ],
)
def test_a_registry_entry_no_publisher_writes_is_refused(
    field: str, value: str, message: str
) -> None:
    with pytest.raises(WeightsError, match=re.escape(f"registry entry of version 7: {message}")):
        VersionInfo.from_fields(7, {**ENTRY.as_fields(), field: value})


def test_the_version_directory_name_is_defined_once() -> None:
    assert version_dir_name(17) == "v17" and dir_version("v17") == 17
    for name in ("v07", "v", "v1.bak", ".tmp-v3", "V3", "v-1", "v٣", "hf", "v" + "9" * 20):
        assert dir_version(name) is None, name


def test_hash_fields_read_text_values_strictly_and_keep_the_rest() -> None:
    fields = HashFields({b"n": b"-4", b"x": b"nan", b"s": b"\xff", b"new": b"1"}, "it", RecordError)
    assert fields.integer("n", signed=True) == -4
    with pytest.raises(RecordError, match="it: n is '-4', not a int"):
        fields.integer("n")
    assert str(fields.number("x", finite=False)) == "nan"
    assert fields.text("s") == "\ufffd" and fields.integer("gone", 5) == 5
    with pytest.raises(RecordError, match="it has no 'gone'"):
        fields.text("gone")
    assert fields.unread() == {"new": "1"}


def test_events_are_the_publishers_json_and_read_back() -> None:
    published = Published(3, 12, 0.8123, "v3", "snap-12")
    evicted = Evicted(1)
    assert published.encode() == (
        '{"event": "published", "version": 3, "step": 12, "lag_s": 0.8123, "path": "v3", '
        '"snapshot_id": "snap-12", "delta_bytes": 0}'
    )
    dropped = Published(4, 13, 0.5, "v4", "snap-13", no_delta="the delta stopped paying")
    assert json.loads(dropped.encode())["no_delta"] == "the delta stopped paying"
    assert parse_event(dropped.encode()) == dropped
    kept = Published(5, 14, 0.5, "v5", "snap-14", delta_bytes=4096)
    assert parse_event(kept.encode()).delta_bytes == 4096
    older = {k: v for k, v in json.loads(published.encode()).items() if k != "delta_bytes"}
    assert parse_event(json.dumps(older)) == published  # an older publisher's event
    assert evicted.encode() == '{"event": "evicted", "version": 1}'
    assert parse_event(published.encode()) == published
    assert parse_event(evicted.encode().encode()) == evicted
    assert parse_event(json.dumps({**json.loads(published.encode()), "lag_s": -2})).lag_s == -2.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("[" * 100_000, "the event is not JSON"),
        ('{"event": "renamed", "version": 3}', "kind 'renamed' is not one of published, evicted"),
        ('{"version": 3}', "kind None"),
        (
            '{"event": "evicted", "version": 0}',
            "the evicted event: version is 0, not an integer >= 1",
        ),
        ('{"event": "evicted", "version": 3, "why": "old"}', "unknown fields \\['why'\\]"),
        ('{"event": "published", "version": 3}', "the published event: lacks 'step'"),
        (
            '{"event": "published", "version": 3, "step": 1, "lag_s": 1, "path": "v3", '
            '"snapshot_id": "s", "delta_bytes": -1}',
            "the published event: delta_bytes is -1",
        ),
        (
            '{"event": "published", "version": 3, "step": 1, "lag_s": "1", "path": "v3", '
            '"snapshot_id": "s"}',
            "the published event: lag_s is '1', not a finite number",
        ),
    ],
)
def test_an_event_no_publisher_sends_is_refused(data: str, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        parse_event(data)


def test_a_quarantine_record_is_the_publishers_json_and_reads_back() -> None:
    record = QuarantineRecord("config.json missing", 9, "/c/quarantine/step-9-1", 1700000000.123)
    assert record.encode() == (
        '{"reason": "config.json missing", "step": 9, "path": "/c/quarantine/step-9-1", '
        '"at": 1700000000.123}'
    )
    assert QuarantineRecord.parse(record.encode()) == record
    unnamed = QuarantineRecord("no step in its name", None, "/c/q/x", 1.0)
    assert QuarantineRecord.parse(unnamed.encode().encode()) == unnamed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not json", "the quarantine record is not JSON"),
        ('{"reason": "r", "step": 1, "path": "p"}', "the quarantine record: lacks 'at'"),
        ('{"reason": "r", "step": -1, "path": "p", "at": 1}', "the quarantine record: step is -1"),
        ('{"reason": 5, "step": 1, "path": "p", "at": 1}', "reason is 5, not a string"),
        ('{"reason": "r", "step": 1, "path": "p", "at": true}', "at is True"),
        ('{"reason": "r", "step": 1, "path": "p", "at": 1e999}', "at is inf"),
        ('{"reason": "r", "step": 1, "path": "p", "at": 1, "who": "me"}', "unknown fields"),
    ],
)
def test_a_quarantine_record_no_publisher_writes_is_refused(data: str, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        QuarantineRecord.parse(data)


def test_the_heartbeat_is_flat_text_fields_and_reads_back() -> None:
    beat = Heartbeat(
        step=7, run_id="r1", consumer="c1", at=1700000000.25, loss=0.6931471805599453,
        last_policy_lag=-1, tokens_per_s=12345.678, mismatch_version=3, last_checkpoint_error="",
    )  # fmt: skip
    assert beat.encode() == {
        "step": "7",
        "run_id": "r1",
        "consumer": "c1",
        "at": "1700000000.25",
        "last_checkpoint_error": "",
        "loss": "0.6931471805599453",
        "mismatch_version": "3",
        "tokens_per_s": "12345.678",
        "last_policy_lag": "-1",
    }
    assert Heartbeat.parse({k.encode(): v.encode() for k, v in beat.encode().items()}) == beat
    later = beat.updated(Heartbeat(step=8, loss=float("nan")))
    assert (later.step, later.run_id, later.encode()["loss"]) == (8, "r1", "nan")
    assert Heartbeat.parse(later.encode()).step == 8  # a figure may be nan, and reads back
    newer = Heartbeat.parse({"step": "1", "custom_field": "42"})
    assert newer.other == {"custom_field": "42"} and "custom_field" not in newer.encode()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("step", "7.0", "step is '7.0', not a int"),
        ("pending", "-3", "pending is '-3', not a int"),
        ("loss", "low", "loss is 'low', not a float"),
        ("at", "nan", "at is 'nan', not a float"),
        ("world_size", "", "world_size is '', not a int"),
    ],
)
def test_a_heartbeat_no_trainer_writes_is_refused(field: str, value: str, message: str) -> None:
    with pytest.raises(RecordError, match=re.escape(f"the trainer heartbeat: {message}")):
        Heartbeat.parse({"step": "1", field: value})


def test_every_trainer_gauge_is_a_figure_of_the_heartbeat() -> None:
    telemetry = pytest.importorskip("weightcast_trainer.telemetry")
    figures = {name for name, value in Heartbeat(**dict.fromkeys(telemetry.GAUGES, 1)).values()}
    assert figures == set(telemetry.GAUGES)
