"""Lease, verify and read what one tensor-parallel rank needs of a version, into host memory.

This is the backend's only use of weightcast's client. Each rank's backend owns one
:class:`RankReader` for the life of its weight-transfer engine: one Redis connection, one
store (a bucket's client and its thread pool) and the rank's base, kept across updates and
closed once, when the engine shuts down. Per update it takes the lease, reads the version's
manifest once (checked against the registry), its config, and the rank's rows or columns,
every block verified. Nothing here knows about vLLM's model; the backend checks the result
against the engine before it touches a parameter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from weightcast.client.engine import check_engine_model
from weightcast.client.vllm.protocol import ResolvedLocation
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.layout import LAYOUT_HF
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import Shard, ShardKind
from weightcast.runtime.config import Config


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
    """``delta`` or ``chain`` when rebuilt from the rank's host base
    (:mod:`weightcast.client.delta_reads`)."""
    read_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(p.tensor.numel() * p.tensor.element_size() for p in self.parts)


class RankReader:
    """Rank ``rank``'s reads from ``source``, for as long as the engine runs.

    ``keep_base``: keep the rank's verified blocks between updates, so that the next version
    is read by its delta (or a chain of deltas, at most ``follow.max_delta_chain``) from them.
    Store outages are ridden out for ``common.store_retry_seconds``, as on any node.
    """

    def __init__(
        self, source: ResolvedLocation, rank: int, keep_base: bool, config: Config
    ) -> None:
        self.source = source
        self.rank = rank
        self.client = WeightsClient(
            source.redis_url,
            source.weights_root,
            namespace=source.namespace,
            node_id=f"{source.node_id}-tp{rank}",
            verified_dir=source.verified_dir,
            keep_base=keep_base,
            store_retry_seconds=config.common.store_retry_seconds,
            max_delta_chain=config.follow.max_delta_chain,
        )

    def serves(self, source: ResolvedLocation, rank: int, keep_base: bool) -> bool:
        """Whether this reader reads what an update from ``source`` asks for."""
        return (self.source, self.rank, self.client.reader.keep_base) == (source, rank, keep_base)

    def stage(self, version: int, tp: int, engine_shape: ModelShape, ep: int = 1) -> StagedVersion:
        """Read this rank's part of ``version`` for an engine of ``engine_shape`` at ``tp``
        (and expert parallelism ``ep``: 1, or ``tp`` with ``enable_expert_parallel``).

        Raises :class:`WeightsError` (or :class:`VersionGone`) for a version this engine must
        not load: another model, fused for another tp, a file that fails its digest.
        """
        start = time.perf_counter()
        client = self.client
        with client.lease(version) as info:
            manifest = client.manifest(info)
            check_engine_model(client.config(info), info, engine_shape)
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
                    tensors = client.rank_tensors(info, self.rank, tp, ep)
                except LayoutError as exc:
                    raise WeightsError(f"version {version}: {exc}") from None
                parts = [RankPart(name, tensor, shards[name]) for name, tensor in tensors.items()]
        stats = client.reader.stats
        return StagedVersion(
            version,
            manifest.layout,
            tuple(parts),
            time.perf_counter() - start,
            stats.via,
            stats.bytes_read,
        )

    def close(self) -> None:
        """Release the Redis connection and the store (its connections and threads)."""
        self.client.close()
