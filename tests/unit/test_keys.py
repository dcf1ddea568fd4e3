"""Key names: one hash tag per namespace, so multi-key scripts stay in one cluster slot."""

from __future__ import annotations

import pytest

from weightcast.contract.keys import Keys

WIRE_NAMES = {
    "batches": "{prod}:batches",
    "dead_letters": "{prod}:batches:dead",
    "latest": "{prod}:weights:latest",
    "versions": "{prod}:weights:versions",
    "deltas": "{prod}:weights:deltas",
    "next_version": "{prod}:weights:next",
    "events": "{prod}:weights:events",
    "snapshots": "{prod}:weights:snapshots",
    "snapshot_order": "{prod}:weights:snapshots:order",
    "quarantine": "{prod}:weights:quarantine",
    "publisher_leader": "{prod}:publisher:leader",
    "nodes": "{prod}:nodes",
    "trainer_heartbeat": "{prod}:trainer:heartbeat",
    "trainer_attempts": "{prod}:trainer:attempts",
    "trainer_running": "{prod}:trainer:running",
    "version": "{prod}:weights:v:3",
    "leases": "{prod}:weights:leases:3",
}
"""Every key of namespace ``prod`` (the per-version keys at version 3), as the wire contract
names it. A key added to ``Keys`` and not listed here fails the test below."""


def every_key(keys: Keys) -> dict[str, str]:
    """Every key name ``Keys`` defines: each property but ``tag``, each method at version 3."""
    names = {}
    for attribute, member in vars(Keys).items():
        if isinstance(member, property) and attribute != "tag":
            names[attribute] = getattr(keys, attribute)
        elif callable(member) and not attribute.startswith("_"):
            names[attribute] = getattr(keys, attribute)(3)
    return names


def test_every_key_is_listed_and_carries_the_namespace_hash_tag() -> None:
    assert every_key(Keys("prod")) == WIRE_NAMES
    assert all(name.startswith("{prod}:") for name in WIRE_NAMES.values())
    assert len(set(WIRE_NAMES.values())) == len(WIRE_NAMES)
    assert Keys().batches == "{wc}:batches"


@pytest.mark.parametrize("namespace", ["", "a{b}", "with space", "x" * 65])
def test_namespaces_that_would_break_the_hash_tag_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        Keys(namespace)
