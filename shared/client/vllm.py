"""Load a published version into a running vLLM engine (``--worker-extension-cls``).

vLLM's stock ``load_weights`` cannot read the vllm-fused names (it matches ``v_proj`` inside
``qkv_proj``), so this module copies each fused block straight into the rank's fused
parameter: the published ``qkv_proj`` / ``gate_up_proj`` block of rank ``r`` is, byte for
byte, what vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` hold on rank ``r``
(kv heads replicated when tp exceeds them). Every other tensor goes, whole, through the
parameter's own ``weight_loader``, which takes the rank's part itself (vocab-parallel rows
with their padding, row-parallel columns, replicated norms). Versions with per-rank files
are already sliced the way those loaders slice; their tensors are copied in directly.

Use it by starting vLLM with
``--worker-extension-cls weightcast.client.vllm.WeightcastWorkerExtension`` and calling
:func:`update_engine` on the ``LLM`` (it runs :meth:`WeightcastWorkerExtension.weightcast_load`
on every worker, then resets the prefix cache, whose cached KV came from the old weights).
vLLM is imported lazily: nothing here needs it until it runs inside a vLLM worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightcast.client.weights import FUSED_KINDS, VersionInfo, WeightsClient, WeightsError
from weightcast.runtime.config import default_node_id


class LoaderError(ValueError):
    """A version that does not fit the engine's parameters; nothing after it was loaded."""


def _copy_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """vLLM's ``default_weight_loader`` when vLLM is not importable: a checked copy."""
    if param.shape != loaded.shape:
        raise LoaderError(f"shape {list(loaded.shape)} does not fit parameter {list(param.shape)}")
    param.data.copy_(loaded)


def _default_weight_loader() -> Callable[[torch.Tensor, torch.Tensor], None]:
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    except ImportError:
        return _copy_weight_loader
    return default_weight_loader


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

    Fused blocks are copied straight into ``qkv_proj`` / ``gate_up_proj``; other tensors go
    whole through ``param.weight_loader`` (per-rank files: copied, already sliced). Returns
    the parameter names loaded; raises :class:`LoaderError` when the version and the engine
    do not match (a missing parameter, a shape, a tp the version was not fused for).
    ``version`` may be the :class:`VersionInfo` a lease returned (no registry read then).
    """
    info = version if isinstance(version, VersionInfo) else client.info(version)
    params = dict(model.named_parameters())
    manifest = client.manifest(info)
    shards = {entry.name: entry.shard for entry in manifest.tensors}
    per_rank = manifest.per_rank_files
    fallback = _default_weight_loader()
    loaded: list[str] = []
    for name, tensor in client.tensors_for_rank(info, tp_rank, tp_size, whole_unfused=not per_rank):
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
        elif per_rank:
            copy_rank_part(param, tensor)
        else:
            getattr(param, "weight_loader", fallback)(param, tensor)
        loaded.append(name)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise LoaderError(
            f"version {info.version} has no tensor for the engine's parameters {missing}"
        )
    return loaded


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
        weights_root: str | None = None,
        node_id: str = "",
    ) -> int:
        """Lease, verify and load ``version`` into this worker's rank; the tensors loaded."""
        tp_rank, tp_size = self.weightcast_tp()
        name = node_id or default_node_id()
        client = WeightsClient(
            redis_url,
            namespace,
            f"{name}-tp{tp_rank}",
            None if weights_root is None else Path(weights_root),
        )
        with client.lease(version) as info:
            return len(load_version(self.model_runner.model, client, info, tp_rank, tp_size))


def update_engine(
    llm: Any,
    redis_url: str,
    namespace: str,
    version: int,
    node_id: str,
    weights_root: str | None = None,
) -> Mapping[str, Any]:
    """Load ``version`` on every worker of ``llm`` (a ``vllm.LLM``), reset its prefix cache
    and report the node as running it in ``{wc}:nodes``."""
    counts = llm.collective_rpc(
        "weightcast_load", args=(redis_url, namespace, version, weights_root, node_id)
    )
    if len(set(counts)) != 1:
        raise WeightsError(f"workers loaded different numbers of tensors: {counts}")
    llm.reset_prefix_cache()
    WeightsClient(redis_url, namespace, node_id, weights_root).report_loaded(version)
    return {"version": version, "workers": len(counts), "tensors": counts[0]}
