"""Delta versions: what a version's manifest says about its delta, and the math, pure.

Beside version N the publisher may write a delta from an earlier version B (its base): for
every digest block of every weights file, the XOR of N's bytes with the same block of B,
compressed with zstd (one frame per block), or nothing for a block that did not change. The
frames follow each other in one file, in the order of :attr:`Delta.files` and their blocks,
so each frame's place follows from the lengths (:meth:`Delta.frames`).

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

DELTA_CODEC = "xor-zstd"
ZSTD_LEVEL = 1
"""zstd's fastest standard level: an XOR of two nearby versions is mostly zero bytes, which
every level compresses alike."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DeltaError(WeightsError):
    """A delta that cannot be applied (a corrupt frame, a base that is not its base)."""


def delta_file_name(base_version: int) -> str:
    return f"delta-from-v{base_version}.{DELTA_CODEC}"


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
        if self.codec != DELTA_CODEC:
            raise DeltaError(f"delta: codec {self.codec!r} is not {DELTA_CODEC}")
        if len({f.name for f in self.files}) != len(self.files):
            raise DeltaError("delta: lists a file twice")

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
    out: np.ndarray | None = None,
) -> bytes:
    """The frame of a changed block: zstd of ``new XOR base`` (a frame holds its size), the
    XOR written into ``out`` when given (``new``'s own array, say) rather than a new array."""
    return compressor.compress(xor(new, base, out=out).data)


def frame_bound(block_bytes: Any) -> Any:
    """The most bytes a zstd frame of a ``block_bytes`` block takes (zstd's
    ``ZSTD_COMPRESSBOUND``; of each, for an array): a longer frame is no frame of that block,
    and is refused before it is read."""
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
) -> np.ndarray:
    """The new block from its ``frame`` and the ``base`` block (uint8):
    ``base XOR unzstd(frame)``, written over ``base`` itself when ``in_place``. ``scratch``
    (uint8, at least the block's length) takes the decompressed bytes instead of a new array.

    A frame that is not zstd, that is longer than any frame of the block, or that declares,
    asks a window for, or holds other than exactly the block's length is a
    :class:`DeltaError` (``base`` untouched). Whatever its header says, nothing larger than
    the block is allocated or decompressed: the header is read first, and the output is
    read into the block's length plus one byte. A frame that decodes but was damaged shows
    only in the digest of the result, which the caller checks."""
    import numpy as np

    size = base.size
    change = np.empty(size, np.uint8) if scratch is None else scratch[:size]
    _unzstd_into(frame, change, decompressor)
    return xor(base, change, out=base if in_place else None)


def _unzstd_into(
    frame: bytes | memoryview, out: np.ndarray, decompressor: zstandard.ZstdDecompressor
) -> None:
    """Decompress ``frame`` into ``out``, which it must fill exactly (see apply_block)."""
    import zstandard

    size = out.size
    if len(frame) > frame_bound(size):
        raise DeltaError(f"a delta frame of {len(frame)} bytes is too long for a block of {size}")
    try:
        header = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"a delta frame does not decode: {exc}") from None
    declared = header.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != size:
        raise DeltaError(f"a delta frame declares {declared} bytes for a block of {size}")
    if header.window_size > max(size, WINDOW_FLOOR):
        raise DeltaError(
            f"a delta frame asks a window of {header.window_size} bytes for a block of {size}"
        )
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
        raise DeltaError(f"a delta frame holds more than the {size} bytes of its block")
    if got != size:
        raise DeltaError(f"a delta frame does not decode: it ends after {got} of {size} bytes")


def compressor() -> zstandard.ZstdCompressor:
    """The publisher's compressor: content size in every frame, no checksum (a node checks
    every rebuilt block against the manifest's digest, so zstd's own checksum would only
    add 20-30% to the encoding and the decoding of a sparse XOR)."""
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)


def decompressor() -> zstandard.ZstdDecompressor:
    import zstandard

    return zstandard.ZstdDecompressor()
