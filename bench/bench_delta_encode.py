"""Where a delta's encoding time goes, stage by stage, and what other encodings of the same
changed blocks would cost, against the write of the same bytes (issue 37).

A sample of a real-size version: ``--mib`` of random bf16 values (drawn as
``bench_publisher.random_tensors`` draws them) as the base, in a file whose pages are warm
(the publisher reads its previous version back), and a new version with ``--changed``
percent of its values moved one ulp at random places (the lowest mantissa bit flipped: what
an Adam step does to a bf16 copy). On one core, one 4 MiB digest block at a time as the
publisher's encoder works (``delta_writer.FileFrames._frame``), each round times:

* ``write``: the baseline, ``os.write`` of the new bytes to a fresh file and ``fsync``;
* ``digest``: xxh3-128 of each block (the writer does it anyway, for the manifest);
* ``read base``: ``preadv`` of the base's block into a reused buffer (page cache);
* ``xor``: :func:`weightcast.contract.delta.xor` of the two blocks;
* ``xor-sparse``: the frames the publisher writes (``contract.delta.encode_block``: one
  pass over both blocks, the changed bytes in zstd), from the two blocks;
* the codecs on the XOR: ``zstd 1`` (the ``xor-zstd`` frames older publishers wrote),
  ``zstd -1``, ``planes`` (the XOR's high and low bytes apart, zstd 1 each), and ``sparse``
  (the positions of the changed 16-bit values as gaps, zstd 1, plus the changed values' XOR
  raw, in numpy).

Printed: the median over rounds of each stage's GiB/s, the codec's frames against the bytes
they cover, and what the encoding would cost (read base + xor + codec) against ``write``.

    .venv/bin/python -m bench delta-encode \\
        --mib 512 --changed 3 15 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

from common import raw_write
from weightcast.contract.delta import compressor, encode_block, scratch_bytes, xor
from weightcast.contract.manifest import BLOCK_BYTES, new_hasher

SPARSE = "xor-sparse"
"""What the publisher writes: one pass over the new block and the base's (no XOR first)."""
Codec = Callable[[np.ndarray], int]
"""One block's XOR (uint8) to the bytes of its frames."""


def zstd_codec(level: int) -> Codec:
    packer = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return lambda change: len(packer.compress(change.data))


def planes_codec() -> Codec:
    packer = zstandard.ZstdCompressor(level=1, write_checksum=False)

    def encode(change: np.ndarray) -> int:
        pairs = change.reshape(-1, 2)
        return len(packer.compress(pairs[:, 0].copy().data)) + len(
            packer.compress(pairs[:, 1].copy().data)
        )

    return encode


def sparse_codec() -> Codec:
    packer = zstandard.ZstdCompressor(level=1, write_checksum=False)

    def encode(change: np.ndarray) -> int:
        values = change.view(np.uint16)
        where = np.flatnonzero(values)
        gaps = np.diff(where, prepend=-1).astype(np.uint32)
        return len(packer.compress(gaps.data)) + 2 * where.size

    return encode


CODECS: dict[str, Callable[[], Codec]] = {
    "zstd 1": lambda: zstd_codec(1),
    "zstd -1": lambda: zstd_codec(-1),
    "planes": planes_codec,
    "sparse": sparse_codec,
}


def versions(nbytes: int, percent: float) -> tuple[np.ndarray, np.ndarray]:
    """A random bf16 base (finite, below 2 in magnitude) and a copy with ``percent`` of its
    values moved one ulp at random places, as uint8."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, size=nbytes // 2, dtype=np.uint16) & 0xBFFF
    new = base.copy()
    moved = rng.choice(base.size, size=int(base.size * percent / 100), replace=False)
    new[moved] ^= 1
    return base.view(np.uint8), new.view(np.uint8)


def write_seconds(data: np.ndarray, path: Path) -> float:
    seconds = raw_write(path, [memoryview(data)])
    path.unlink()
    return seconds


def one_round(base_fd: int, new: np.ndarray, work: Path) -> dict[str, tuple[float, int]]:
    """Each stage's seconds over every block, and a codec's frame bytes."""
    seconds = {"write": write_seconds(new, work / "new")}
    seconds |= dict.fromkeys(("digest", "read base", SPARSE, "xor", *CODECS), 0.0)
    sizes = dict.fromkeys((SPARSE, *CODECS), 0)
    packer, scratch = compressor(), np.empty(scratch_bytes(BLOCK_BYTES), np.uint8)
    codecs = {name: make() for name, make in CODECS.items()}
    buffer = np.empty(BLOCK_BYTES, np.uint8)
    for start in range(0, new.size, BLOCK_BYTES):
        block, held = new[start : start + BLOCK_BYTES], buffer[: min(BLOCK_BYTES, new.size - start)]
        marks = [time.perf_counter()]
        hasher = new_hasher("xxh3-128")
        hasher.update(block.data)
        hasher.hexdigest()
        marks.append(time.perf_counter())
        os.preadv(base_fd, [held], start)
        marks.append(time.perf_counter())
        at = time.perf_counter()
        sizes[SPARSE] += len(encode_block(block, held, packer, scratch))
        seconds[SPARSE] += time.perf_counter() - at
        marks.append(time.perf_counter())
        change = xor(block, held, out=held)
        marks.append(time.perf_counter())
        stages = ("digest", "read base", SPARSE, "xor")
        for name, seconds_spent in zip(stages, np.diff(marks), strict=True):
            if name != SPARSE:  # timed on its own above
                seconds[name] += seconds_spent
        for name, encode in codecs.items():
            at = time.perf_counter()
            sizes[name] += encode(change)
            seconds[name] += time.perf_counter() - at
    return {name: (s, sizes.get(name, 0)) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--changed", type=float, nargs="+", default=[3.0, 15.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    args = parser.parse_args()
    nbytes = args.mib * 2**20
    print(f"{os.cpu_count()} CPUs, {args.mib} MiB, rounds {args.rounds}, load {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="wc-encode-", dir=args.dir) as tmp:
        work = Path(tmp)
        for percent in args.changed:
            base, new = versions(nbytes, percent)
            (work / "base").write_bytes(base.data)
            fd = os.open(work / "base", os.O_RDONLY)
            try:
                rounds = [one_round(fd, new, work) for _ in range(args.rounds)]
            finally:
                os.close(fd)
            report(percent, nbytes, rounds)


def report(percent: float, nbytes: int, rounds: list[dict[str, tuple[float, int]]]) -> None:
    seconds = {name: statistics.median(r[name][0] for r in rounds) for name in rounds[0]}
    write = seconds["write"]
    print(f"{percent:g}% of the values moved ({len(rounds)} rounds, medians):")
    for name, spent in seconds.items():
        line = f"  {name:<10} {nbytes / spent / 2**30:6.2f} GiB/s  {spent / write:5.2f}x write"
        if name in CODECS or name == SPARSE:
            size = rounds[0][name][1] / nbytes
            xored = 0.0 if name == SPARSE else seconds["xor"]  # one pass: its own XOR
            encoding = (seconds["read base"] + xored + spent) / write
            line += f"  frames {100 * size:5.2f}% of the bytes, encoding {encoding:4.2f}x write"
        print(line)


if __name__ == "__main__":
    main()
