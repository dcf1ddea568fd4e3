"""Snapshot -> version directory in the vllm-fused layout, written atomically.

Everything goes to ``.tmp-v<N>/`` (safetensors, ``config.json``, ``manifest.json``), is
fsynced, and only then renamed to ``v<N>/``: a ``v*`` directory is always whole.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from publisher.snapshot_reader import CorruptSnapshot, Snapshot, load_tensors, read_config
from shared.durable import fsync_path, publish_dir, write_json
from shared.layout import LAYOUT_VLLM_FUSED, LayoutError, ModelShape, assemble, plan_vllm_fused
from shared.manifest import MANIFEST_NAME, Manifest, TensorEntry, file_entry, sha256_bytes
from shared.snapshots import CONFIG_NAME

WEIGHTS_FILE = "model.safetensors"
TMP_VERSION_PREFIX = ".tmp-v"


def version_dir_name(version: int) -> str:
    return f"v{version}"


@dataclass(frozen=True)
class Published:
    path: Path
    manifest: Manifest
    manifest_sha256: str


def convert(snapshot: Snapshot, weights_dir: Path, version: int, tp: int) -> Published:
    """Write ``snapshot`` as version ``version``; raises :class:`CorruptSnapshot`."""
    config = read_config(snapshot)
    try:
        shape = ModelShape.from_hf_config(config)
        tensors = load_tensors(snapshot)
        plan = plan_vllm_fused({name: t.shape[0] for name, t in tensors.items()}, shape, tp)
        fused = {p.name: assemble(p, tensors) for p in plan}
    except (LayoutError, RuntimeError) as exc:
        raise CorruptSnapshot(str(exc)) from None
    del tensors

    tmp = weights_dir / f"{TMP_VERSION_PREFIX}{version}"
    final = weights_dir / version_dir_name(version)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(fused, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    os.chmod(tmp / WEIGHTS_FILE, 0o644)  # safetensors creates it 0600; nodes may be other users
    write_json(tmp / CONFIG_NAME, config)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in fused.values()}
    manifest = Manifest(
        version=version,
        step=snapshot.step,
        run_id=snapshot.info.run_id,
        snapshot_id=snapshot.info.snapshot_id,
        layout=LAYOUT_VLLM_FUSED,
        tp=tp,
        dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
        files=[file_entry(tmp / WEIGHTS_FILE), file_entry(tmp / CONFIG_NAME)],
        tensors=[
            TensorEntry(
                p.name,
                WEIGHTS_FILE,
                list(fused[p.name].shape),
                str(fused[p.name].dtype).removeprefix("torch."),
                dict(p.shard),
            )
            for p in plan
        ],
    )
    manifest_json = manifest.to_json().encode()
    (tmp / MANIFEST_NAME).write_bytes(manifest_json)
    for path in (tmp / WEIGHTS_FILE, tmp / MANIFEST_NAME, tmp):
        fsync_path(path)
    publish_dir(tmp, final)
    return Published(final, manifest, sha256_bytes(manifest_json))
