"""Lease, verify and read what one tensor-parallel rank needs of a version, into host memory.

This is the backend's only use of weightcast's client (:class:`WeightsClient`): the registry
entry, the lease (held while reading), the manifest checked against the registry, the files'
digests, and the rank's rows or columns. Nothing here knows about vLLM's model; the backend
checks the result against the engine before it touches a parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from weightcast.client.reader import VersionReader
from weightcast.client.vllm.protocol import Source
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.layout import LAYOUT_HF
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import Shard, ShardKind


@dataclass(frozen=True)
class RankPart:
    """One published tensor as this rank holds it (the whole tensor for the ``hf`` layout).

    ``shard`` is the manifest's shard spec (``sharding.rank_slice``), of kind ``hf`` for a
    whole HF tensor.
    """

    name: str
    tensor: torch.Tensor
    shard: Shard


@dataclass(frozen=True)
class StagedVersion:
    """A version's part for one rank, verified and in memory, not yet in the model."""

    version: int
    layout: str
    parts: tuple[RankPart, ...]
    read_seconds: float
    via: str = "full"
    """``delta`` when rebuilt from the rank's host base (:mod:`weightcast.client.delta_reads`)."""
    read_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.tensor.numel() * p.tensor.element_size() for p in self.parts)


def stage(
    source: Source,
    version: int,
    rank: int,
    tp: int,
    engine_shape: ModelShape,
    files: VersionReader | None = None,
    ep: int = 1,
) -> StagedVersion:
    """Read rank ``rank``'s part of ``version`` for an engine of ``engine_shape`` at ``tp``
    (and expert parallelism ``ep``: 1, or ``tp`` with ``enable_expert_parallel``); through
    ``files`` when given (a reader kept across updates, holding the rank's base).

    Raises :class:`WeightsError` (or :class:`VersionGone`) for a version this engine must not
    load: another model, fused for another tp, a file that fails its digest.
    """
    start = time.perf_counter()
    client = WeightsClient(
        source.redis_url,
        source.weights_root,
        namespace=source.namespace,
        node_id=f"{source.node_id}-tp{rank}",
        verified_dir=source.verified_dir,
    )
    if files is not None:
        client.files = files
    try:
        with client.lease(version) as info:
            try:
                shape = ModelShape.from_hf_config(client.config(info))
            except LayoutError as exc:
                raise WeightsError(f"version {version}: {exc}") from None
            if shape != engine_shape:
                raise WeightsError(
                    f"version {version} is a different model ({shape}) from the engine's "
                    f"({engine_shape})"
                )
            manifest = client.manifest(info)
            if manifest.layout == LAYOUT_HF:
                # Whole HF tensors: vLLM's loaders take the rank's share themselves.
                parts = [RankPart(n, t, Shard(ShardKind.HF)) for n, t in client.load(info).items()]
            else:
                if manifest.tp != tp:
                    raise WeightsError(
                        f"version {version} is fused for tp={manifest.tp}; this engine runs "
                        f"tp={tp} (publish with --tp {tp}, or --layout hf or both)"
                    )
                shards = {entry.name: entry.shard for entry in manifest.tensors}
                try:
                    parts = [
                        RankPart(name, tensor, shards[name])
                        for name, tensor in client.rank_tensors(info, rank, tp, ep).items()
                    ]
                except LayoutError as exc:
                    raise WeightsError(f"version {version}: {exc}") from None
    finally:
        client.close()
    stats = client.files.stats
    return StagedVersion(
        version,
        manifest.layout,
        tuple(parts),
        time.perf_counter() - start,
        stats.via,
        stats.bytes_read,
    )
