"""Load a published version into a running vLLM engine (``--worker-extension-cls``).

Each worker reads and verifies only its own tensor-parallel rank's part of every tensor
(:meth:`WeightsClient.rank_tensors <weightcast.client.weights.WeightsClient.rank_tensors>`)
and copies it into the rank's parameter: the published ``qkv_proj`` / ``gate_up_proj`` block
of rank ``r`` is, byte for byte, what vLLM's ``QKVParallelLinear`` /
``MergedColumnParallelLinear`` hold on rank ``r`` (kv heads replicated when tp exceeds
them); vocab-parallel rows go to the top of the padded parameter (padding rows zeroed),
row-parallel columns and replicated tensors are copied as they are.

Use it by starting vLLM with
``--worker-extension-cls weightcast.client.vllm.WeightcastWorkerExtension`` and calling
:func:`update_engine` on the ``LLM`` (it runs :meth:`WeightcastWorkerExtension.weightcast_load`
on every worker, then resets the prefix cache, whose cached KV came from the old weights).
vLLM is imported lazily: nothing here needs it until it runs inside a vLLM worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from weightcast.client.weights import VersionInfo, WeightsClient
from weightcast.contract.errors import WeightsError
from weightcast.runtime.config import default_node_id

FUSED_KINDS = ("qkv", "gate_up")
"""Shard kinds of the fused tensors: laid out for one tp, each rank's block contiguous."""


class LoaderError(ValueError):
    """A version that does not fit the engine's parameters; nothing after it was loaded."""


def copy_rank_part(param: torch.Tensor, part: torch.Tensor) -> None:
    """Copy a rank's part into its parameter; rows past it (vocab padding) become zero."""
    if part.shape[1:] != param.shape[1:] or part.shape[0] > param.shape[0]:
        raise LoaderError(
            f"rank part {list(part.shape)} does not fit parameter {list(param.shape)}"
        )
    param.data[: part.shape[0]].copy_(part)
    param.data[part.shape[0] :].zero_()


def load_version(
    model: nn.Module,
    client: WeightsClient,
    version: int | VersionInfo,
    tp_rank: int,
    tp_size: int,
) -> list[str]:
    """Load ``version`` into ``model`` (one tensor-parallel rank of a vLLM model).

    Every tensor's rank part is read and verified before any parameter is touched; fused
    blocks must fit their parameter exactly, other parts are copied with
    :func:`copy_rank_part`. Returns the parameter names loaded; raises :class:`LoaderError`
    when the version and the engine do not match (a missing parameter, a shape), and
    ``LayoutError`` for a tp the version was not fused for. ``version`` may be the
    :class:`VersionInfo` a lease returned (no registry read then).
    """
    info = version if isinstance(version, VersionInfo) else client.info(version)
    params = dict(model.named_parameters())
    shards = {entry.name: entry.shard for entry in client.manifest(info).tensors}
    parts = client.rank_tensors(info, tp_rank, tp_size)
    for name, tensor in parts.items():
        param = params.get(name)
        if param is None:
            raise LoaderError(f"the engine has no parameter {name!r} (version {info.version})")
        if shards[name].get("kind") in FUSED_KINDS:
            if param.shape != tensor.shape:
                raise LoaderError(
                    f"{name}: rank {tp_rank} block is {list(tensor.shape)}, the engine's "
                    f"parameter {list(param.shape)}; was the engine started with tp={tp_size}?"
                )
            param.data.copy_(tensor)
        else:
            copy_rank_part(param, tensor)
    missing = sorted(set(params) - set(parts))
    if missing:
        raise LoaderError(
            f"version {info.version} has no tensor for the engine's parameters {missing}"
        )
    return list(parts)


class WeightcastWorkerExtension:
    """Mixed into every vLLM worker by ``--worker-extension-cls``; called by collective_rpc.

    vLLM provides ``self.model_runner`` (with ``.model``) on the worker this extends.
    """

    model_runner: Any

    def weightcast_tp(self) -> tuple[int, int]:
        """This worker's tensor-parallel rank and size, from vLLM's process groups."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def weightcast_load(
        self,
        redis_url: str,
        namespace: str,
        version: int,
        weights_root: str,
        node_id: str = "",
    ) -> int:
        """Lease, verify and load ``version`` into this worker's rank; the tensors loaded."""
        tp_rank, tp_size = self.weightcast_tp()
        name = node_id or default_node_id()
        client = WeightsClient(
            redis_url, weights_root, namespace=namespace, node_id=f"{name}-tp{tp_rank}"
        )
        try:
            with client.lease(version) as info:
                return len(load_version(self.model_runner.model, client, info, tp_rank, tp_size))
        finally:
            client.close()


def update_engine(
    llm: Any,
    redis_url: str,
    namespace: str,
    version: int,
    node_id: str,
    weights_root: str,
) -> Mapping[str, Any]:
    """Load ``version`` on every worker of ``llm`` (a ``vllm.LLM``), reset its prefix cache
    and report the node as running it in ``{wc}:nodes``."""
    counts = llm.collective_rpc(
        "weightcast_load", args=(redis_url, namespace, version, weights_root, node_id)
    )
    if len(set(counts)) != 1:
        raise WeightsError(f"workers loaded different numbers of tensors: {counts}")
    llm.reset_prefix_cache()
    client = WeightsClient(redis_url, weights_root, namespace=namespace, node_id=node_id)
    try:
        client.report_loaded(version)
    finally:
        client.close()
    return {"version": version, "workers": len(counts), "tensors": counts[0]}
