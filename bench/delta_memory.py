"""What a node's read costs in memory when a version has very many blocks (issue 29): peak RSS
above the start and seconds, per read, each in a fresh process.

``make DIR``: two versions published by the real converter (tp 1, a small Qwen3 in bf16, one
value in 37 moved between them), then both re-cut by hand into blocks of ``--block-bytes``
(digests recomputed) and the delta of the second rebuilt frame by frame for those blocks, as
a publisher would write it for such blocks. ``measure DIR full|delta|manifest``: a fresh node
reads v2 in full; a node holding v1 reads v2 by delta; or the manifest parser meets 64 MiB of
empty lists. Peak RSS is ``VmHWM`` reset through ``/proc/self/clear_refs`` before the read.

    PYTHONPATH=tests .venv/bin/python -m bench delta-memory make /tmp/dm --block-bytes 40
    .venv/bin/python -m bench delta-memory measure /tmp/dm delta
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from common import vm


def make(directory: Path, block_bytes: int) -> None:
    import torch

    from weightcast.contract.delta import DeltaFile, compressor, encode_block
    from weightcast.contract.manifest import (
        MANIFEST_NAME,
        BlockDigests,
        Manifest,
        digest_bytes,
        file_entry,
        sha256_bytes,
    )
    from weightcast.contract.snapshot_format import read_complete
    from weightcast_publisher.converter import ConvertOptions, convert
    from weightcast_publisher.snapshot_scan import Snapshot

    from helpers.models import hf_state, shape_of
    from helpers.snapshots import write_snapshot

    shape = dataclasses.replace(
        shape_of(8, 8, 32, hidden=256, inter=1024, tied=False), vocab_size=4096
    )
    state = hf_state(shape, torch.bfloat16)
    first = write_snapshot(directory / "checkpoints", 1, shape, state)
    for tensor in state.values():
        tensor.view(-1).view(torch.int16)[::37] += 1
    second = write_snapshot(directory / "checkpoints", 2, shape, state)
    weights = directory / "weights"
    for number, snapshot in ((1, first), (2, second)):
        convert(Snapshot(snapshot, read_complete(snapshot)), weights, number, ConvertOptions())
    name, data, shas = "model.vllm-fused", {}, {}
    for number in (1, 2):
        path = weights / f"v{number}"
        manifest = Manifest.read(path)
        raw = (path / name).read_bytes()
        data[number] = raw
        cut = [raw[i : i + block_bytes] for i in range(0, len(raw), block_bytes)]
        blocks = BlockDigests("xxh3-128", block_bytes, [digest_bytes("xxh3-128", b) for b in cut])
        files = [
            dataclasses.replace(f, blocks=blocks) if f.name == name else f for f in manifest.files
        ]
        if number == 2:
            assert manifest.delta is not None
            old = data[1]
            squeeze, frames, lengths = compressor(), [], []
            for i in range(0, len(raw), block_bytes):
                new, base = raw[i : i + block_bytes], old[i : i + block_bytes]
                frame = b"" if new == base else encode_block(new, base, squeeze)
                frames.append(frame)
                lengths.append(len(frame))
            delta_path = path / manifest.delta.file
            delta_path.write_bytes(b"".join(frames))
            delta = dataclasses.replace(
                manifest.delta, base_manifest_sha256=shas[1], files=[DeltaFile(name, lengths)]
            )
            files = [file_entry(delta_path) if f.name == delta.file else f for f in files]
            manifest = dataclasses.replace(manifest, delta=delta)
        text = dataclasses.replace(manifest, files=files).to_json().encode()
        (path / MANIFEST_NAME).write_bytes(text)
        shas[number] = sha256_bytes(text)
        print(f"v{number}: {len(raw)} bytes, {len(cut)} blocks, manifest {len(text)} bytes")
    (directory / "shas.json").write_text(json.dumps(shas))


def measure(directory: Path, what: str) -> None:
    from weightcast.client.reader import VersionReader
    from weightcast.contract.manifest import Manifest
    from weightcast.contract.version_info import VersionInfo

    weights = directory / "weights"
    shas = {int(k): v for k, v in json.loads((directory / "shas.json").read_text()).items()}

    def info(number: int) -> VersionInfo:
        m = Manifest.read(weights / f"v{number}")
        return VersionInfo(
            version=number, path=f"v{number}", step=m.step, layout=m.layout, tp=m.tp,
            dtype=m.dtype, bytes=m.total_bytes, manifest_sha256=shas[number],
            run_id=m.run_id, created_at=time.time(),
        )  # fmt: skip

    reader = VersionReader(weights, keep_base=what == "delta")
    if what == "delta":
        reader.load(info(1))
    hostile = b"[" + b"[]," * (64 * 1024 * 1024 // 3 - 1) + b"[]]"
    Path("/proc/self/clear_refs").write_text("5")
    before, start = vm("VmRSS"), time.perf_counter()
    if what == "manifest":
        try:
            Manifest.from_json(hostile)
        except Exception as exc:
            print(type(exc).__name__, str(exc)[:120])
    else:
        reader.load(info(2))
        print(f"via {reader.stats.via} {reader.stats.reason!r}: {reader.stats.bytes_read} bytes")
    seconds = time.perf_counter() - start
    print(f"{what}: peak +{(vm('VmHWM') - before) / 2**20:.0f} MiB, {seconds:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("make")
    made.add_argument("directory", type=Path)
    made.add_argument("--block-bytes", type=int, default=40)
    measured = commands.add_parser("measure")
    measured.add_argument("directory", type=Path)
    measured.add_argument("what", choices=["full", "delta", "manifest"])
    args = parser.parse_args()
    if args.command == "make":
        make(args.directory, args.block_bytes)
    else:
        measure(args.directory, args.what)


if __name__ == "__main__":
    main()
