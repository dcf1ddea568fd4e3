"""Delta versions: what a version's manifest says about its delta, and the math, pure.

Beside version N the publisher may write a delta from an earlier version B (its base): for
every digest block of every weights file, one frame that holds what changed from the same
block of B, or nothing for a block that did not change. The frames follow each other in one
file, in the order of :attr:`Delta.files` and their blocks, so each frame's place follows
from the lengths (:meth:`Delta.frames`).

The frame's encoding is the delta's ``codec``, named in the manifest and the file's name:

* ``xor-sparse`` (written since issue 37): a zstd frame of the changed words of ``N XOR B``
  in three streams (:mod:`weightcast.contract.sparse_xor`): its cost follows what changed,
  not the block's size;
* ``xor-zstd`` (read, no longer written): zstd of the whole ``N XOR B``, which cost more CPU
  than the write it rode along with, so two cores dropped every delta.

A node reads both; a delta in a codec it does not know makes it read the version in full
and say why (:meth:`Delta.refusal`).

A delta is only written when the two versions have the same plan (the same files, tensors
and block boundaries), so block ``i`` of B and of N hold the same tensor bytes. A node that
holds B's blocks, verified, rebuilds N's with :func:`apply_block` and checks each against N's
block digest before using it: the digests, not the delta, are what prove the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcast.contract.errors import WeightsError

if TYPE_CHECKING:  # numpy and zstandard only for the math, not to parse a manifest
    import numpy as np
    import zstandard

SPARSE_CODEC = "xor-sparse"
ZSTD_CODEC = "xor-zstd"
DELTA_CODEC = SPARSE_CODEC
"""What the publisher writes."""
CODECS = (SPARSE_CODEC, ZSTD_CODEC)
"""What a node reads."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CODEC = re.compile(r"[a-z0-9][a-z0-9.-]{0,31}")
"""What a codec's name may be: a manifest naming a codec this code does not know still
parses (its version is read in full, :meth:`Delta.refusal` says why), so a publisher may
move to a new delta format without its nodes refusing the versions."""


class DeltaError(WeightsError):
    """A delta that cannot be applied (a corrupt frame, a base that is not its base)."""


def delta_file_name(base_version: int, codec: str = DELTA_CODEC) -> str:
    return f"delta-from-v{base_version}.{codec}"


@dataclass(frozen=True)
class DeltaFile:
    """The frames of one weights file: each block's frame length, 0 for an unchanged block."""

    name: str
    lengths: list[int]


@dataclass(frozen=True)
class Delta:
    """The ``delta`` of a manifest: from which version, in which file, frame by frame."""

    base_version: int
    base_manifest_sha256: str
    file: str
    files: list[DeltaFile]
    codec: str = DELTA_CODEC

    def __post_init__(self) -> None:
        if not _SHA256.fullmatch(self.base_manifest_sha256):
            raise DeltaError(f"delta: base_manifest_sha256 {self.base_manifest_sha256!r}")
        if not _CODEC.fullmatch(self.codec):
            raise DeltaError(f"delta: codec {self.codec!r} is no codec name")
        if len({f.name for f in self.files}) != len(self.files):
            raise DeltaError("delta: lists a file twice")

    def refusal(self) -> str:
        """Why a node cannot apply this delta at all ('' when it can): a codec it does not
        know."""
        if self.codec not in CODECS:
            known = " or ".join(CODECS)
            return f"the delta is {self.codec}, which this node does not read (it reads {known})"
        return ""

    @property
    def bytes(self) -> int:
        """The delta file's size: every frame."""
        return sum(sum(f.lengths) for f in self.files)

    def file_frames(self, name: str) -> tuple[int, list[int]] | None:
        """Where the frames of weights file ``name`` begin in the delta file, and each
        block's frame length; None for a file not listed."""
        at = 0
        for entry in self.files:
            if entry.name == name:
                return at, entry.lengths
            at += sum(entry.lengths)
        return None

    def frames(self, name: str) -> list[tuple[int, int]]:
        """Where block ``i``'s frame of weights file ``name`` lies in the delta file:
        ``(offset, length)``, length 0 for an unchanged block; [] for a file not listed."""
        at = 0
        for entry in self.files:
            if entry.name == name:
                return list(_placed(at, entry.lengths))
            at += sum(entry.lengths)
        return []


def _placed(at: int, lengths: list[int]) -> Iterator[tuple[int, int]]:
    for length in lengths:
        yield at, length
        at += length


def delta_from_json(raw: Any, error: type[Exception]) -> Delta:
    """The manifest's ``delta`` object, every field checked (``error`` names the field)."""
    from weightcast.contract.untrusted import Fields

    known = ("base_version", "base_manifest_sha256", "file", "files", "codec")
    top = Fields(raw, "delta", error, known)
    files = []
    for index, item in enumerate(top.items("files")):
        entry = Fields(item, f"delta.files[{index}]", error, ("name", "lengths"))
        files.append(DeltaFile(entry.text("name"), entry.integers("lengths")))
    try:
        return Delta(
            top.integer("base_version", minimum=1),
            top.text("base_manifest_sha256"),
            top.text("file"),
            files,
            top.text("codec"),
        )
    except DeltaError as exc:
        raise error(str(exc)) from None


# -- the math ------------------------------------------------------------------------------


def xor(
    a: bytes | memoryview | np.ndarray,
    b: bytes | memoryview | np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``a XOR b`` byte by byte (equal lengths, or :class:`DeltaError`), into ``out`` (a
    writable uint8 array of that length, which may be ``a`` itself) or a new array; eight
    bytes at a time where the length allows."""
    import numpy as np

    left, right = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    if left.size != right.size:
        raise DeltaError(f"XOR of {left.size} bytes with {right.size}")
    result = np.empty(left.size, np.uint8) if out is None else out
    if left.size % 8 == 0:
        np.bitwise_xor(left.view(np.uint64), right.view(np.uint64), out=result.view(np.uint64))
    else:
        np.bitwise_xor(left, right, out=result)
    return result


def encode_block(
    new: bytes | memoryview | np.ndarray,
    base: bytes | memoryview | np.ndarray,
    compressor: zstandard.ZstdCompressor,
    scratch: np.ndarray | None = None,
) -> bytes:
    """The ``xor-sparse`` frame of a changed block: zstd of the three streams of
    ``new XOR base`` (:mod:`weightcast.contract.sparse_xor`) behind their 12-byte header.
    ``scratch`` (uint8, at least :func:`scratch_bytes`) takes the streams instead of a new
    array; neither block is changed."""
    import numpy as np

    from weightcast.contract.sparse_xor import pack_payload

    left, right = _readonly(new), _readonly(base)
    if left.size != right.size:
        raise DeltaError(f"XOR of {left.size} bytes with {right.size}")
    need = scratch_bytes(left.size)
    out = np.empty(need, np.uint8) if scratch is None or scratch.size < need else scratch
    return compressor.compress(out[: pack_payload(left, right, out)].data)


def _readonly(data: bytes | memoryview | np.ndarray) -> np.ndarray:
    """``data`` as a read-only uint8 array: numba compiles a kernel once per argument type
    (writable and read-only arrays are two), so the encoder sees one type, the one
    :func:`weightcast.contract.sparse_xor.compile_kernels` compiles ahead."""
    import numpy as np

    array = np.frombuffer(data, np.uint8)
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def encode_zstd_block(
    new: bytes | memoryview | np.ndarray,
    base: bytes | memoryview | np.ndarray,
    compressor: zstandard.ZstdCompressor,
    out: np.ndarray | None = None,
) -> bytes:
    """The ``xor-zstd`` frame of a changed block: zstd of ``new XOR base``, the XOR written
    into ``out`` when given (``new``'s own array, say) rather than a new array. (What an
    older publisher wrote: nodes still read it.)"""
    return compressor.compress(xor(new, base, out=out).data)


def scratch_bytes(block_bytes: int, codec: str = DELTA_CODEC) -> int:
    """The room a frame of a ``block_bytes`` block takes decoded: its streams, or its XOR."""
    from weightcast.contract.sparse_xor import payload_bound

    return payload_bound(block_bytes) if codec == SPARSE_CODEC else block_bytes


def frame_bound(block_bytes: Any, codec: str = DELTA_CODEC) -> Any:
    """The most bytes a frame of a ``block_bytes`` block takes (zstd's
    ``ZSTD_COMPRESSBOUND`` of what it holds decoded; of each, for an array): a longer frame
    is no frame of that block, and is refused before it is read."""
    from weightcast.contract.sparse_xor import payload_bound

    if codec == SPARSE_CODEC:
        block_bytes = payload_bound(block_bytes)
    small = 128 * 1024
    return (
        block_bytes + (block_bytes >> 8) + (((small - block_bytes) * (block_bytes < small)) >> 11)
    )


WINDOW_FLOOR = 8 * 1024 * 1024
"""The largest zstd window a frame may ask for beyond its block's length (a frame written
without its content size names the compression level's window; level 1's is 512 KiB)."""


def apply_block(
    frame: bytes | memoryview,
    base: np.ndarray,
    decompressor: zstandard.ZstdDecompressor,
    in_place: bool = False,
    scratch: np.ndarray | None = None,
    codec: str = DELTA_CODEC,
) -> np.ndarray:
    """The new block from its ``frame`` (in ``codec``) and the ``base`` block (uint8),
    written over ``base`` itself when ``in_place``. ``scratch`` (uint8, at least
    :func:`scratch_bytes`) takes the decompressed bytes instead of a new array.

    A frame that is not zstd, that is longer than any frame of the block, that declares or
    asks a window for more than a frame of the block holds, whose decoded streams do not
    describe a change of exactly this block (or, ``xor-zstd``, whose XOR is not exactly the
    block's length) is a :class:`DeltaError`, ``base`` untouched: every frame is decoded
    and checked whole before a byte of the block is changed. Whatever its header says,
    nothing larger than the bound is allocated or decompressed. A frame that decodes but was
    damaged shows only in the digest of the result, which the caller checks."""
    import numpy as np

    size = base.size
    if len(frame) > frame_bound(size, codec):
        raise DeltaError(f"a delta frame of {len(frame)} bytes is too long for a block of {size}")
    need = scratch_bytes(size, codec)
    room = np.empty(need, np.uint8) if scratch is None or scratch.size < need else scratch
    if codec == ZSTD_CODEC:
        change = room[:size]
        _unzstd_into(frame, change, decompressor, _declared(frame, size, size, exact=False))
        return xor(base, change, out=base if in_place else None)
    if codec != SPARSE_CODEC:
        raise DeltaError(f"no codec {codec!r}")
    from weightcast.contract.sparse_xor import (
        HEADER_BYTES,
        STREAM_ERRORS,
        apply_streams,
        check_streams,
        split_payload,
    )

    length = _declared(frame, need, size, exact=True)
    if length < HEADER_BYTES:
        raise DeltaError(f"a delta frame holds {length} bytes, less than its header")
    payload = room[:length]
    _unzstd_into(frame, payload, decompressor, length)
    streams = split_payload(payload)
    if isinstance(streams, str):
        raise DeltaError(streams)
    gaps, masks, values = streams
    broken = check_streams(gaps, masks, values, size)
    if broken:
        raise DeltaError(f"a delta frame does not fit its block of {size}: {STREAM_ERRORS[broken]}")
    block = base if in_place else base.copy()
    apply_streams(gaps, masks, values, block)
    return block


def _declared(frame: bytes | memoryview, most: int, size: int, exact: bool) -> int:
    """The bytes ``frame`` holds decoded, from its header: at most ``most``, and declared
    when ``exact`` (else ``most`` when it declares none); its window no larger than that
    (or :data:`WINDOW_FLOOR`). ``size`` is the block's, for the messages."""
    import zstandard

    try:
        header = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"a delta frame does not decode: {exc}") from None
    declared = header.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        if exact:
            raise DeltaError("a delta frame does not declare its size")
        declared = most
    elif declared > most or (not exact and declared != most):
        raise DeltaError(f"a delta frame declares {declared} bytes for a block of {size}")
    if header.window_size > max(declared, WINDOW_FLOOR):
        raise DeltaError(
            f"a delta frame asks a window of {header.window_size} bytes for a block of {size}"
        )
    return declared


def _unzstd_into(
    frame: bytes | memoryview,
    out: np.ndarray,
    decompressor: zstandard.ZstdDecompressor,
    size: int,
) -> None:
    """Decompress ``frame`` into ``out`` (``size`` bytes), which it must fill exactly: the
    output is read into that length plus one byte, no more."""
    import zstandard

    got, extra = 0, b""
    try:
        with decompressor.stream_reader(frame) as reader:
            view = memoryview(out)
            while got < size and (count := reader.readinto(view[got:])):
                got += count
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"a delta frame does not decode: {exc}") from None
    if extra:
        raise DeltaError(f"a delta frame holds more than the {size} bytes it declares")
    if got != size:
        raise DeltaError(f"a delta frame does not decode: it ends after {got} of {size} bytes")


def compressor() -> zstandard.ZstdCompressor:
    """The publisher's compressor: level 1's fast strategy with a 1 KiB match table and
    matches of 7 bytes or more (a sparse payload is mostly entropy, few long repeats: 30%
    less time than level 1 at 15% of the values moved, frames no larger; a 512 KiB window),
    content size in every frame (a node allocates nothing before it knows it), no checksum
    (a node checks every rebuilt block against the manifest's digest, so zstd's own would
    only add to the encoding and the decoding)."""
    import zstandard

    params = zstandard.ZstdCompressionParameters(
        strategy=zstandard.STRATEGY_FAST,
        hash_log=10,
        min_match=7,
        window_log=19,
        write_content_size=True,
        write_checksum=False,
    )
    return zstandard.ZstdCompressor(compression_params=params)


def decompressor() -> zstandard.ZstdDecompressor:
    import zstandard

    return zstandard.ZstdDecompressor()
