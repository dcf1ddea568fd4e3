"""The real-size tier's versions and the walk every node path takes through them.

Qwen3-0.6B's shape (28 layers, hidden 1024, vocabulary 151936: 1.19 GB in bf16) with random
weights of a plausible scale; six versions written by the real publisher to a bucket (its
weights directory keeps them too, so directory nodes read the same versions), each moving
3% of the values of the one before by one ulp, as an RL step does. Every version stays live
(``keep``), and every delta is kept (``delta_behind`` wait: two loaded cores encode a 0.6B delta
slower than the disk writes it, and the publisher would otherwise drop them all). Version 5
is then corrupted in both places: a byte of its weights file and of its delta.

The tp 2 and FP8 engines walk :data:`WIDE` instead: the same widths and vocabulary in two
layers, whose largest tensor still spans many ranged GETs and staging windows; at 28 layers
each of their fresh references would be another 0.6B engine (five per walk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import save_file

from weightcast.contract.fusion import assemble, plan_vllm_fused
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE
from weightcast.contract.manifest import DEFAULT_DIGEST, Manifest, new_hasher
from weightcast.contract.model_shape import SHAPES, ModelShape
from weightcast.contract.snapshot_format import snapshot_name
from weightcast.contract.version_info import VersionInfo
from weightcast.local.s3_server import S3Server

from helpers.models import drift, plausible_state
from helpers.s3 import store_settings, unique_bucket
from helpers.versions import Deployment

SHAPE = SHAPES["0.6B"]
WIDE = dataclasses.replace(SHAPE, num_layers=2)
"""0.6B's widths and vocabulary in 2 of its 28 layers (0.35 GB in bf16): its largest tensor,
the tied 311 MB embedding (155 MB a rank at tp 2), is 19 ranged GETs and several staging
windows, as at 0.6B."""
VERSIONS = 6
CORRUPT = 5
MOVED_EVERY = 33
"""One value in 33 of each tensor moves per version: 3%."""
PUBLISHER = {"keep": 100, "delta_behind": "wait"}
"""``publisher.*`` settings of the tier: every version live, every delta kept."""
REFUSED = "refused"


@dataclass(frozen=True)
class Step:
    """One update of the walk: the version offered, and how the node must take it."""

    version: int
    via: str
    """``full``, ``delta``, ``chain``, or :data:`REFUSED` (the node keeps what it held)."""


WALK = (
    Step(1, "full"),
    Step(2, "delta"),
    Step(3, "delta"),
    Step(1, "full"),  # back to an older live version
    Step(4, "chain"),  # 3 versions behind: the deltas of 2, 3 and 4
    Step(CORRUPT, REFUSED),  # its delta fails, then its full read meets the flipped byte
    Step(6, "full"),  # the chain from 4 breaks at 5's delta: read whole
    Step(2, "full"),  # back again
    Step(3, "delta"),  # and forward
)
SERVED = sorted({s.version for s in WALK if s.via != REFUSED})
"""The versions a node serves on the walk (a vLLM engine's fresh references)."""


@dataclass
class RealSizeVersions:
    """The published versions: where nodes read them, and what they hold."""

    deployment: Deployment
    digests: dict[int, dict[str, str]]
    """Each version's fused tensors at tp 1, by name: their digests (``bytes_digest``; bf16
    versions at tp 1 only)."""
    hf_dirs: dict[int, Path]
    """An HF model directory of each version in :data:`SERVED`: the one written beside the
    versions when asked for, else the version's own ``hf/`` layout (``layout = both``)."""

    @property
    def directory(self) -> Path:
        return self.deployment.root / "weights"

    @property
    def shape(self) -> ModelShape:
        return self.deployment.shape

    def info(self, version: int) -> VersionInfo:
        fields = self.deployment.client.hgetall(self.deployment.keys.version(version))
        return VersionInfo.from_fields(version, fields)


def bytes_digest(tensor: torch.Tensor) -> str:
    hasher = new_hasher(DEFAULT_DIGEST)
    hasher.update(tensor.contiguous().view(torch.uint8).numpy())
    return hasher.hexdigest()


def fused_digests(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, str]:
    """The digest of each tensor a tp-1 node holds of ``state`` (vLLM's fused tensors)."""
    rows = {name: t.shape[0] for name, t in state.items()}
    return {t.name: bytes_digest(assemble(t, state)) for t in plan_vllm_fused(rows, shape, 1)}


def publish_versions(deployment: Deployment, hf_root: Path | None = None) -> RealSizeVersions:
    """:data:`VERSIONS` versions of ``deployment.shape`` through ``deployment``, each with its
    delta from the one before; then version :data:`CORRUPT` corrupted. With ``hf_root``, an
    HF directory of each served version there (fresh engines start from it)."""
    shape = deployment.shape
    state = plausible_state(shape, seed=1)
    config = shape.to_hf_config()
    settings = deployment.publisher_settings
    plain = settings.tp == 1 and settings.quantize == "none"
    digests, hf_dirs = {}, {}
    for step in range(1, VERSIONS + 1):
        if step > 1:
            drift(state, step, MOVED_EVERY)
        version = deployment.publish(state)
        assert version == step
        # Published: the snapshot is not read again (the next delta's base is the version);
        # the tier holds a copy of each version in three places already.
        shutil.rmtree(deployment.root / "checkpoints" / snapshot_name(step))
        if plain:
            digests[version] = fused_digests(state, shape)
        if version not in SERVED:
            continue
        if hf_root is None:
            hf_dirs[version] = deployment.root / "weights" / f"v{version}" / "hf"
            continue
        hf_dirs[version] = hf_root / f"v{version}"
        hf_dirs[version].mkdir(parents=True)
        (hf_dirs[version] / "config.json").write_text(json.dumps(config))
        save_file(state, str(hf_dirs[version] / "model.safetensors"), {"format": "pt"})
    versions = RealSizeVersions(deployment, digests, hf_dirs)
    for version in range(2, VERSIONS + 1):
        info = versions.info(version)
        assert (info.delta_from, info.no_delta) == (version - 1, ""), info
    corrupt(versions, CORRUPT)
    return versions


def corrupt(versions: RealSizeVersions, version: int) -> None:
    """Flip a byte of one changed block of ``version``'s weights file, in that block and in
    its delta frame, in the weights directory and (re-uploaded) in the bucket: whichever
    rank reads the block, by delta or in full, meets the flipped byte (a rank reads only
    the blocks of its part: bytes no rank reads may be corrupt without harm)."""
    directory = versions.directory / f"v{version}"
    remote = versions.deployment.bucket()
    for path in corrupt_version(directory):
        if remote is not None:
            remote.upload_file(path, remote.key(directory.name, path.name))


def corrupt_version(directory: Path) -> list[Path]:
    """Flip a byte in the middle of one changed block of the version in ``directory`` (its
    fused weights file, else the first its delta covers: an ``hf`` layout's) and in that
    block's delta frame; the two files changed."""
    manifest = Manifest.read(directory)
    assert manifest.delta is not None
    names = [file.name for file in manifest.delta.files]
    name = FUSED_WEIGHTS_FILE if FUSED_WEIGHTS_FILE in names else names[0]
    frames = manifest.delta.frames(name)
    changed = [i for i, (_, length) in enumerate(frames) if length]
    block = changed[len(changed) // 2]  # inside a large tensor, away from the header
    (entry,) = (f for f in manifest.files if f.name == name)
    assert entry.blocks is not None
    start, stop = entry.blocks.span(block, entry.bytes)
    offset, length = frames[block]
    places = {
        directory / name: (start + stop) // 2,
        directory / manifest.delta.file: offset + length // 2,
    }
    for path, at in places.items():
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x10]))
    return list(places)


@contextlib.contextmanager
def published(
    redis_url: str,
    s3_server: S3Server,
    root: Path,
    hf_root: Path | None = None,
    shape: ModelShape = SHAPE,
    **publisher: object,
) -> Iterator[RealSizeVersions]:
    """:func:`publish_versions` of ``shape`` into a new bucket of ``s3_server`` (and
    ``root/weights``), under a namespace of their own, with the server's client environment
    set meanwhile (readers in this process and the processes it starts use it); its bucket
    and ``root`` are removed at the end. ``publisher``: ``publisher.*`` settings beside
    :data:`PUBLISHER` (``tp=2``, ``quantize="fp8"``)."""
    bucket = unique_bucket()
    s3_server.create_bucket(bucket)
    client = redis.Redis.from_url(redis_url)
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.client_env().items():
            env.setenv(name, value)
        store = store_settings(s3_server, bucket)
        deployment = Deployment(
            client,
            Keys(f"realsize-{bucket}"),
            root,
            redis_url,
            shape=shape,
            store=store,
            **{**PUBLISHER, **publisher},
        )
        try:
            yield publish_versions(deployment, hf_root)
        finally:
            deployment.publisher.lock.release()
            deployment.publisher.close()
            s3_server.delete_bucket(bucket)  # gigabytes, which deleted objects would still hold
            shutil.rmtree(root, ignore_errors=True)
            client.close()
