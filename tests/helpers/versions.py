"""Versions published by the real publisher, and hand-made changes to them (copies,
re-registrations, new digests)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import redis
import torch
from safetensors.torch import load_file, save_file

from weightcast.client.chains import DEFAULT_MAX_DELTA_CHAIN
from weightcast.client.weights import WeightsClient
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file
from weightcast.contract.manifest import (
    BLOCK_BYTES,
    DEFAULT_DIGEST,
    MANIFEST_FORMAT,
    MANIFEST_FORMATS,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    file_digests,
    file_entry,
    sha256_bytes,
    sha256_file,
)
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import rank_slice
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS
from weightcast.runtime.settings import load_config
from weightcast.store.mirror import MirroredStore
from weightcast_publisher.daemon import Publisher

from helpers.models import SMALL_GQA
from helpers.snapshots import write_snapshot

if TYPE_CHECKING:
    from weightcast.store.s3 import S3Store


class Deployment:
    """The real publisher, driven one snapshot at a time, plus readers of its versions."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        root: Path,
        redis_url: str,
        tp: int = 1,
        shape: ModelShape = SMALL_GQA,
        store: dict[str, object] | None = None,
        **publisher: object,
    ) -> None:
        """``store``: the object-store settings (``weights_url``, ``s3_endpoint_url``...)
        when versions go to a bucket rather than stay in ``root/weights``; ``publisher``:
        more ``publisher.*`` settings (``quantize="fp8"``)."""
        self.client, self.keys, self.root, self.redis_url = client, keys, root, redis_url
        self.shape = shape
        settings = {
            "redis_url": redis_url,
            "namespace": keys.namespace,
            "checkpoint_dir": root / "checkpoints",
            "weights_dir": root / "weights",
            "publisher.tp": tp,
            **(store or {}),
            **{f"publisher.{name}": value for name, value in publisher.items()},
        }
        config = load_config(env={}, overrides=settings)
        self.location = config.common.weights_location()
        """Where nodes read the versions: the weights directory, or the bucket's URL."""
        self.store_retry_seconds = config.common.store_retry_seconds
        self.common = config.common
        self.publisher_settings = config.publisher
        self.publisher = Publisher(config)
        self.registry = self.publisher.registry
        self.evictor = self.publisher.housekeeping.evictor
        self.step = 0

    def publish(self, state: dict[str, torch.Tensor] | None = None) -> int:
        """Write the next snapshot (``state``, or the shape's fixed random one) and run one
        publisher pass: publish, evict, prune."""
        self.step += 1
        write_snapshot(self.root / "checkpoints", self.step, self.shape, state)
        self.publisher.scan_once()
        return int(self.client.get(self.keys.latest))

    def bucket(self) -> S3Store | None:
        """The bucket the publisher's weights directory is mirrored to; None without one."""
        from weightcast.store.s3 import S3Store  # boto3 only where a bucket is used

        store = self.publisher.store
        if not isinstance(store, MirroredStore):
            return None
        assert isinstance(store.remote, S3Store)
        return store.remote

    def reader(
        self,
        node_id: str = "node-a",
        lease_seconds: float = 30.0,
        keep_base: bool = False,
        max_delta_chain: int = DEFAULT_MAX_DELTA_CHAIN,
    ) -> WeightsClient:
        """A node of this deployment (``keep_base``: one that takes versions by delta)."""
        return WeightsClient(
            self.redis_url,
            self.location,
            namespace=self.keys.namespace,
            node_id=node_id,
            lease_seconds=lease_seconds,
            store_retry_seconds=self.store_retry_seconds,
            keep_base=keep_base,
            max_delta_chain=max_delta_chain,
        )


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same tensor names, each bitwise equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def split_per_rank(deployment: Deployment, version: int) -> int:
    """Register a copy of ``version`` with per-rank files, as ``--per-rank-files`` writes it:
    rank r's file holds, under the fused names, what ``rank_slice`` gives rank r."""
    client, keys = deployment.client, deployment.keys
    fields = client.hgetall(keys.version(version))
    source = deployment.root / "weights" / fields[b"path"].decode()  # relative or absolute
    manifest = Manifest.read(source)
    tensors = load_file(str(source / FUSED_WEIGHTS_FILE))
    target = source.parent / f"v{version}-per-rank"
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    entries, files = [], [file_entry(target / "config.json")]
    for rank in range(manifest.tp):
        name = fused_rank_file(rank, manifest.tp)
        parts = {}
        for entry in manifest.tensors:
            part = rank_slice(entry.shard, entry.shape, rank, manifest.tp)
            full = tensors[entry.name]
            parts[entry.name] = (
                full if part is None else full.narrow(part.dim, part.start, part.stop - part.start)
            ).contiguous()
            entries.append(
                dataclasses.replace(
                    entry, file=name, shape=list(parts[entry.name].shape), rank=rank
                )
            )
        save_file(parts, str(target / name))
        files.append(file_entry(target / name))
    text = (
        dataclasses.replace(manifest, files=files, tensors=entries, per_rank_files=True)
        .to_json()
        .encode()
    )
    (target / MANIFEST_NAME).write_bytes(text)
    copy = version + 100
    client.hset(
        keys.version(copy),
        mapping={**fields, b"path": target.name, b"manifest_sha256": sha256_bytes(text)},
    )
    client.zadd(keys.versions, {copy: copy})
    return copy


def publish_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor] | None = None,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """Write a snapshot aside and rename it into ``checkpoint_dir``, as the trainer does, so a
    running publisher never sees it half-written."""
    staging = checkpoint_dir.parent / f"staging-{uuid.uuid4().hex[:8]}"
    written = write_snapshot(staging, step, shape, state, format)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / written.name
    os.rename(written, final)
    staging.rmdir()
    return final


def rank_byte_ranges(directory: Path, rank: int, tp: int) -> list[tuple[int, int]]:
    """The byte ranges of ``directory``'s model.vllm-fused that tp rank ``rank`` needs: the
    header and each tensor's part (its rows; a column block: every byte of the tensor, since
    each row holds some of the rank's columns), worked out from the file's header and the
    manifest's shard specs."""
    with open(directory / FUSED_WEIGHTS_FILE, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    ranges = [(0, 8 + length)]
    for entry in Manifest.read(directory).tensors:
        begin, end = (8 + length + o for o in header[entry.name]["data_offsets"])
        part = rank_slice(entry.shard, entry.shape, rank, tp)
        if part is not None and part.dim == 0:
            row = (end - begin) // entry.shape[0]
            begin, end = begin + part.start * row, begin + part.stop * row
        ranges.append((begin, end))
    return ranges


def copy_version(deployment: Deployment, version: int) -> tuple[int, Path]:
    """A copy of ``version``'s directory as ``v<N>`` under a fresh version number N, to be
    changed and then registered with :func:`register_version`."""
    number = deployment.registry.allocate_version()
    weights = deployment.root / "weights"
    source = weights / deployment.client.hget(deployment.keys.version(version), "path").decode()
    target = weights / f"v{number}"
    shutil.copytree(source, target, symlinks=True)
    return number, target


def register_version(
    deployment: Deployment,
    number: int,
    like: int,
    path: str | None = None,
    drop: tuple[str, ...] = (),
) -> None:
    """Register ``v<number>`` as the publisher would (version hash, live set, latest, event),
    its hash copied from version ``like`` but for ``path`` (``v<number>`` unless given), the
    SHA-256 of the directory's manifest as it is now, and the fields in ``drop`` left out."""
    client, keys = deployment.client, deployment.keys
    path = f"v{number}" if path is None else path
    fields = {k.decode(): v for k, v in client.hgetall(keys.version(like)).items()}
    manifest = deployment.root / "weights" / f"v{number}" / MANIFEST_NAME
    if manifest.is_file() and not manifest.is_symlink():
        fields["manifest_sha256"] = sha256_bytes(manifest.read_bytes())
    fields["path"] = path
    for name in drop:
        fields.pop(name, None)
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.version(number), mapping=fields)
    pipe.zadd(keys.versions, {number: number})
    pipe.set(keys.latest, number)
    pipe.publish(keys.events, json.dumps({"event": "published", "version": number}))
    pipe.execute()


def redigest(
    directory: Path, algorithm: str = DEFAULT_DIGEST, block_bytes: int = BLOCK_BYTES
) -> bytes:
    """Rewrite ``directory``'s manifest with the digests of each listed file as it is now (so
    a deliberately broken file passes them): format 2 with block digests, or format 1 with a
    whole-file SHA-256 when ``algorithm`` is ``sha256``. Returns the manifest's bytes."""
    manifest = Manifest.read(directory)
    if algorithm == "sha256":
        files = [
            FileEntry(
                f.name, (directory / f.name).stat().st_size, sha256=sha256_file(directory / f.name)
            )
            for f in manifest.files
        ]
        manifest_format = MANIFEST_FORMATS[0]
    else:
        files = [
            FileEntry(
                f.name,
                (directory / f.name).stat().st_size,
                blocks=file_digests(directory / f.name, algorithm, block_bytes),
            )
            for f in manifest.files
        ]
        manifest_format = MANIFEST_FORMAT
    text = dataclasses.replace(manifest, files=files, format=manifest_format).to_json().encode()
    (directory / MANIFEST_NAME).write_bytes(text)
    return text
