"""Delta chains: a node that holds version K and is asked for N, whose delta is from a
version after K, applies the deltas of the versions between (each one's ``delta_from`` the
one before) instead of reading N whole, when that pays.

Pure: which versions are the links (:func:`chain_links`, from registry entries), and whether
applying them pays (:func:`chain_refusal`, from the bytes each link and the full read would
read). The reads themselves are :meth:`weightcast.client.reader.VersionReader.rank_tensors`
with ``links``; the leases, :class:`weightcast.client.weights.WeightsClient`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weightcast.contract.version_info import VersionInfo

DEFAULT_MAX_DELTA_CHAIN = 16
"""Deltas a node applies in a row at most (``follow.max_delta_chain``)."""


def chain_links(
    target: VersionInfo,
    held: int,
    entry: Callable[[int], VersionInfo | None],
    max_links: int,
) -> tuple[list[VersionInfo], str]:
    """The registry entries of the versions between ``held`` and ``target``, oldest first,
    following ``delta_from`` down from ``target`` (``entry(n)``: version n's entry, None when
    it has none); and '' when the chain reaches ``held`` within ``max_links`` deltas (the
    target's included) and together they are smaller than ``target``'s bytes, else why not
    (the links are then empty)."""
    links: list[VersionInfo] = []
    at = target
    while at.delta_from != held:
        if at.delta_from == 0:
            return [], f"version {at.version} has no delta"
        if at.delta_from < held:
            return [], f"the delta of version {at.version} is from version {at.delta_from}"
        if len(links) + 1 >= max_links:
            return [], f"the chain from version {held} is longer than {max_links} deltas"
        link = entry(at.delta_from)
        if link is None:
            return [], f"version {at.delta_from} (a link of the chain) is gone"
        links.append(link)
        at = link
    links.reverse()
    sizes = [link.delta_bytes for link in (*links, target)]
    why = chain_refusal(sizes, target.bytes, max_links)
    return ([], why) if why else (links, "")


def chain_refusal(link_bytes: Sequence[int], full_bytes: int, max_links: int) -> str:
    """Why applying deltas of ``link_bytes`` (one per link, in order) does not pay against a
    full read of ``full_bytes``: more links than ``max_links``, or not fewer bytes together;
    '' when it pays."""
    if len(link_bytes) > max_links:
        return f"a chain of {len(link_bytes)} deltas is longer than {max_links}"
    total = sum(link_bytes)
    if total >= full_bytes:
        return (
            f"the chain of {len(link_bytes)} deltas ({total} bytes) is not smaller than "
            f"the version ({full_bytes} bytes)"
        )
    return ""
