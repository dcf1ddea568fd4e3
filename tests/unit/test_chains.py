"""The pure choice of a delta chain: which versions are its links (from registry entries),
and whether applying them pays against reading the version whole."""

from __future__ import annotations

from weightcast.client.chains import chain_links, chain_refusal
from weightcast.contract.version_info import VersionInfo

FULL = 1000


def entry(version: int, delta_from: int, delta_bytes: int = 10, size: int = FULL) -> VersionInfo:
    return VersionInfo(
        version=version, path=f"v{version}", step=version, layout="vllm-fused", tp=1,
        dtype="bfloat16", bytes=size, manifest_sha256="0" * 64, run_id="run", created_at=0.0,
        delta_from=delta_from, delta_bytes=delta_bytes if delta_from else 0,
    )  # fmt: skip


def registry(*entries: VersionInfo) -> dict[int, VersionInfo]:
    return {e.version: e for e in entries}


def test_the_links_are_the_versions_between_oldest_first() -> None:
    found = registry(entry(2, 1), entry(3, 2), entry(4, 3))
    links, why = chain_links(entry(5, 4), 1, found.get, max_links=16)
    assert (why, [link.version for link in links]) == ("", [2, 3, 4])


def test_links_follow_delta_from_over_version_numbers_never_registered() -> None:
    found = registry(entry(3, 1), entry(7, 3))  # 2, 4, 5, 6: never registered
    links, why = chain_links(entry(9, 7), 1, found.get, max_links=16)
    assert (why, [link.version for link in links]) == ("", [3, 7])


def test_a_chain_longer_than_the_bound_is_refused() -> None:
    found = registry(entry(2, 1), entry(3, 2), entry(4, 3))
    assert chain_links(entry(5, 4), 1, found.get, max_links=4)[1] == ""
    links, why = chain_links(entry(5, 4), 1, found.get, max_links=3)
    assert (links, why) == ([], "the chain from version 1 is longer than 3 deltas")


def test_a_missing_link_or_one_without_a_delta_breaks_the_chain() -> None:
    assert chain_links(entry(5, 4), 1, registry(entry(2, 1), entry(4, 3)).get, 16) == (
        [],
        "version 3 (a link of the chain) is gone",
    )
    assert chain_links(entry(5, 4), 1, registry(entry(4, 0)).get, 16) == (
        [],
        "version 4 has no delta",
    )


def test_a_chain_that_passes_below_the_version_held_is_refused() -> None:
    # The node holds 3, but 5's chain goes 5 <- 4 <- 2: 3 was never 4's base.
    links, why = chain_links(entry(5, 4), 3, registry(entry(4, 2)).get, 16)
    assert (links, why) == ([], "the delta of version 4 is from version 2")


def test_a_chain_pays_only_when_its_deltas_together_are_smaller_than_the_version() -> None:
    found = registry(entry(2, 1, 400), entry(3, 2, 400))
    links, why = chain_links(entry(4, 3, 199), 1, found.get, 16)
    assert [link.version for link in links] == [2, 3] and why == ""
    links, why = chain_links(entry(4, 3, 200), 1, found.get, 16)
    assert links == []
    assert why == "the chain of 3 deltas (1000 bytes) is not smaller than the version (1000 bytes)"


def test_chain_refusal_on_the_bytes_a_rank_reads() -> None:
    assert chain_refusal([10, 20, 30], 61, 3) == ""
    assert chain_refusal([10, 20, 30], 60, 3).startswith("the chain of 3 deltas (60 bytes)")
    assert chain_refusal([1, 1, 1], 60, 2) == "a chain of 3 deltas is longer than 2"
