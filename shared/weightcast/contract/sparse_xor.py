"""The ``xor-sparse`` delta's kernels: one pass over two blocks, touching only what changed.

A block is read as 8-byte words (its last ``size % 8`` bytes as one short word). For every
word that differs between the new block and the base, the change is three small pieces, each
in a stream of its own:

* ``gaps``: how many words after the previous changed word it is (LEB128: 1 byte below 128);
* ``masks``: one byte, bit ``k`` set where byte ``k`` of the word changed;
* ``values``: the changed bytes of ``new XOR base``, in order, nothing for an unchanged byte.

An Adam step moves a few percent of bf16 values by an ulp or so, so three streams that hold
one to three bytes per changed word are a few percent of the block, and the encoder's cost is
one read of each block, not a compressor over all of it (zstd over the whole XOR cost more
than the write: docs/benchmarks.md). Applying is ``base[at] ^= value`` at each changed byte:
its own inverse, so a node undoes an applied frame by applying it again.

Every kernel is compiled by numba (``nogil``: the publisher's encoding threads and a node's
apply threads run in parallel); the framing around them is :mod:`weightcast.contract.delta`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

HEADER_BYTES = 12
"""The payload's header: three little-endian uint32, changed words, gap bytes, value bytes."""
GAP_BYTES = 3
"""The most bytes a gap takes: 21 bits, more words than a block of up to 16 MiB holds."""

_LOW_BITS = np.uint64(0x0101010101010101)
_GATHER = np.uint64(0x0102040810204080)
"""Multiplying the low bit of each byte by this gathers the eight bits into the top byte."""
_LOWEST = np.array([0] + [(m & -m).bit_length() - 1 for m in range(1, 256)], np.uint8)
"""The lowest set bit of each mask: the encoder visits only the bytes that changed."""


def word_count(size: Any) -> Any:
    """Words of a block of ``size`` bytes (of each, for an array): 8 bytes each, and one for
    a short tail."""
    return -(-size // 8)


def payload_bound(size: Any) -> Any:
    """The most bytes the payload of a block of ``size`` bytes (of each, for an array) can
    hold: every word changed, every gap at its longest (an encoder writes far less; a
    decoder allocates no more)."""
    words = word_count(size)
    return HEADER_BYTES + GAP_BYTES * words + words + size


def pack_payload(new: np.ndarray, base: np.ndarray, out: np.ndarray) -> int:
    """The payload of ``new XOR base`` (uint8 blocks of one size) in ``out`` (uint8, at
    least :func:`payload_bound` of the size): the header, then gaps, masks and values, one
    after the other; its length. (:func:`encode_streams` writes each stream into its own
    room; they are moved down here.)"""
    changed, gap_bytes, value_bytes = encode_streams(new, base, out)
    words = word_count(new.size)
    masks_at = HEADER_BYTES + GAP_BYTES * words
    values_at = masks_at + words
    out[:HEADER_BYTES].view("<u4")[:] = (changed, gap_bytes, value_bytes)
    at = HEADER_BYTES + gap_bytes
    out[at : at + changed] = out[masks_at : masks_at + changed]
    at += changed
    out[at : at + value_bytes] = out[values_at : values_at + value_bytes]
    return at + value_bytes


def split_payload(payload: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | str:
    """The gaps, masks and values of a payload (at least its header long), or why its
    header does not add up to its length."""
    changed, gap_bytes, value_bytes = (int(n) for n in payload[:HEADER_BYTES].view("<u4"))
    if HEADER_BYTES + gap_bytes + changed + value_bytes != payload.size:
        return (
            f"a delta frame's header says {changed} words, {gap_bytes} gap bytes and "
            f"{value_bytes} value bytes, not the {payload.size - HEADER_BYTES} bytes it holds"
        )
    masks_at = HEADER_BYTES + gap_bytes
    values_at = masks_at + changed
    return payload[HEADER_BYTES:masks_at], payload[masks_at:values_at], payload[values_at:]


@njit(nogil=True, cache=True)
def _put_gap(out: np.ndarray, at: int, gap: int) -> int:
    while gap >= 128:
        out[at] = (gap & 127) | 128
        at += 1
        gap >>= 7
    out[at] = gap
    return at + 1


@njit(nogil=True, cache=True)
def encode_streams(new: np.ndarray, base: np.ndarray, out: np.ndarray) -> tuple[int, int, int]:
    """The three streams of ``new XOR base`` (uint8 blocks of one size) into ``out`` (uint8,
    at least :func:`payload_bound` of the size): gaps from byte ``HEADER_BYTES``, masks from
    ``HEADER_BYTES + GAP_BYTES * words``, values after the masks' room. Returns the count of
    changed words, the gaps' bytes and the values' bytes (the caller packs them together)."""
    size = new.size
    whole = size // 8
    words = (size + 7) // 8
    fresh = new[: whole * 8].view(np.uint64)
    held = base[: whole * 8].view(np.uint64)
    gap_at = HEADER_BYTES
    mask_at = HEADER_BYTES + GAP_BYTES * words
    value_at = mask_at + words
    gaps0, masks0, values0 = gap_at, mask_at, value_at
    last = -1
    for i in range(whole):
        x = fresh[i] ^ held[i]
        if x != 0:
            gap_at = _put_gap(out, gap_at, i - last)
            last = i
            bits = x | (x >> np.uint64(4))
            bits |= bits >> np.uint64(2)
            bits |= bits >> np.uint64(1)
            mask = np.uint8(((bits & _LOW_BITS) * _GATHER) >> np.uint64(56))
            out[mask_at] = mask
            mask_at += 1
            while mask:
                out[value_at] = (x >> np.uint64(8 * _LOWEST[mask])) & np.uint64(0xFF)
                value_at += 1
                mask &= mask - np.uint8(1)
    if words > whole:  # the short tail word
        mask = 0
        for k in range(size - whole * 8):
            value = new[whole * 8 + k] ^ base[whole * 8 + k]
            if value != 0:
                mask |= 1 << k
                out[value_at] = value
                value_at += 1
        if mask:
            gap_at = _put_gap(out, gap_at, whole - last)
            out[mask_at] = mask
            mask_at += 1
    return mask_at - masks0, gap_at - gaps0, value_at - values0


@njit(nogil=True, cache=True)
def _get_gap(gaps: np.ndarray, at: int) -> tuple[int, int]:
    """The gap that begins at ``gaps[at]`` and where the next one begins; the gap is -1 when
    the stream ends inside it, -2 when it runs longer than :data:`GAP_BYTES`."""
    gap = 0
    shift = 0
    while True:
        if at >= gaps.size:
            return -1, at
        if shift > 7 * (GAP_BYTES - 1):
            return -2, at
        byte = gaps[at]
        at += 1
        gap |= (byte & 127) << shift
        shift += 7
        if byte < 128:
            return gap, at


@njit(nogil=True, cache=True)
def check_streams(gaps: np.ndarray, masks: np.ndarray, values: np.ndarray, size: int) -> int:
    """0 when the streams describe a change of a block of ``size`` bytes exactly (every gap
    at least 1 and at most 3 bytes, every word inside the block, every mask naming at least
    one byte and none past the block's end, the values one per named byte, nothing left
    over); else the number of the first rule broken (:data:`STREAM_ERRORS`). Reads the
    streams only: a frame is checked whole before a byte of the block is changed."""
    whole = size // 8
    tail = size - whole * 8
    words = whole + (1 if tail else 0)
    word = -1
    at = 0
    named = 0
    for j in range(masks.size):
        gap, at = _get_gap(gaps, at)
        if gap == -1:
            return 1
        if gap <= 0:
            return 2
        word += gap
        if word >= words:
            return 3
        mask = masks[j]
        if mask == 0:
            return 4
        if word == whole and mask >> tail != 0:
            return 3
        for k in range(8):
            named += (mask >> k) & 1
    if at != gaps.size:
        return 5
    if named != values.size:
        return 6
    return 0


STREAM_ERRORS = {
    1: "its gaps end early",
    2: "a gap is zero or too long",
    3: "it changes bytes past the block's end",
    4: "a word's mask names no byte",
    5: "its gaps hold more than its words",
    6: "its values are not one per changed byte",
}
"""What :func:`check_streams`'s answer means."""


@njit(nogil=True, cache=True)
def apply_streams(gaps: np.ndarray, masks: np.ndarray, values: np.ndarray, block: np.ndarray):  # type: ignore[no-untyped-def]
    """``block ^= change`` at each changed byte the streams name (checked first with
    :func:`check_streams`: this trusts them)."""
    word = -1
    at = 0
    value_at = 0
    for j in range(masks.size):
        gap, at = _get_gap(gaps, at)
        word += gap
        mask = masks[j]
        start = word * 8
        while mask:
            block[start + _LOWEST[mask]] ^= values[value_at]
            value_at += 1
            mask &= mask - np.uint8(1)


def compile_kernels() -> None:
    """Compile every kernel now (or load it from numba's cache, some 0.2 s): a long-lived
    process calls this at its start, so that its first delta does not pay for it inside a
    publish or an update."""
    block = np.zeros(9, np.uint8)
    room = np.empty(payload_bound(block.size), np.uint8)
    frozen = block.view()
    frozen.flags.writeable = False  # the encoder's blocks, as delta.encode_block passes them
    encode_streams(frozen, frozen, room)
    empty = room[:0]
    check_streams(empty, empty, empty, block.size)
    apply_streams(empty, empty, empty, block)
