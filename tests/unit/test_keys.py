"""Key names: one hash tag per namespace, so multi-key scripts stay in one cluster slot."""

from __future__ import annotations

import pytest

from weightcast.contract.keys import Keys


def test_every_key_carries_the_namespace_hash_tag() -> None:
    keys = Keys("prod")
    names = [
        keys.batches,
        keys.dead_letters,
        keys.latest,
        keys.versions,
        keys.next_version,
        keys.events,
        keys.nodes,
        keys.snapshots,
        keys.trainer_heartbeat,
        keys.version(3),
        keys.leases(3),
    ]
    assert all(name.startswith("{prod}:") for name in names)
    assert len(set(names)) == len(names)
    assert keys.version(3) == "{prod}:weights:v:3"
    assert keys.leases(12) == "{prod}:weights:leases:12"
    assert Keys().batches == "{wc}:batches"


@pytest.mark.parametrize("namespace", ["", "a{b}", "with space", "x" * 65])
def test_namespaces_that_would_break_the_hash_tag_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        Keys(namespace)
