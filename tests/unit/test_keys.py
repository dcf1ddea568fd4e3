"""Key names: one hash tag per namespace, so multi-key scripts stay in one cluster slot."""

from __future__ import annotations

import pytest

from weightcast.contract.keys import Keys


def every_key(keys: Keys) -> dict[str, str]:
    """Every key name ``Keys`` defines: each property but ``tag``, each method at version 3."""
    names = {}
    for attribute, member in vars(Keys).items():
        if isinstance(member, property) and attribute != "tag":
            names[attribute] = getattr(keys, attribute)
        elif callable(member) and not attribute.startswith("_"):
            names[attribute] = getattr(keys, attribute)(3)
    return names


def test_every_key_carries_the_namespace_hash_tag() -> None:
    names = every_key(Keys("prod"))
    assert {"batches", "quarantine", "publisher_leader", "version", "leases"} <= set(names)
    assert all(name.startswith("{prod}:") for name in names.values()), names
    assert len(set(names.values())) == len(names)
    assert Keys("prod").version(3) == "{prod}:weights:v:3"
    assert Keys("prod").leases(12) == "{prod}:weights:leases:12"
    assert Keys().batches == "{wc}:batches"


@pytest.mark.parametrize("namespace", ["", "a{b}", "with space", "x" * 65])
def test_namespaces_that_would_break_the_hash_tag_are_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        Keys(namespace)
