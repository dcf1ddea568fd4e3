"""The node record of ``{wc}:nodes``, defined once: what nodes write is what readers parse,
and what no node writes is refused with the reason."""

from __future__ import annotations

import json

import pytest

from weightcast.contract.nodes import NodeReport


def test_a_report_reads_back_as_written() -> None:
    for report in (
        NodeReport(3, 1700000000.5),
        NodeReport(0, 1.0, "v4 not loaded: bad shape"),
        NodeReport(5, 2.0, via="delta", read_bytes=4096),
    ):
        assert NodeReport.parse(report.encode()) == report
    assert json.loads(NodeReport(3, 2.0).encode()) == {"version": 3, "at": 2.0}  # no error key


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("[" * 100_000, "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"version": "two", "at": 1}', "version 'two'"),
        ('{"version": true, "at": 1}', "version True"),
        ('{"version": -1, "at": 1}', "version -1"),
        ('{"version": 1}', "time None"),
        ('{"version": 1, "at": "now"}', "time 'now'"),
        ('{"version": 1, "at": 1, "error": 5}', "error 5"),
        ('{"version": 1, "at": 1, "via": "rsync"}', "via 'rsync' is not one of delta, chain, full"),
        ('{"version": 1, "at": 1, "via": "full", "read_bytes": 1.5}', "read_bytes 1.5"),
    ],
)
def test_what_no_node_writes_is_refused_with_the_reason(data: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodeReport.parse(data)
