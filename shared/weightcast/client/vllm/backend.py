"""The ``weightcast`` weight-transfer backend: each vLLM worker loads its own rank's part.

vLLM creates one instance per worker (one per tensor-parallel rank), in the worker process,
when the engine runs with ``weight_transfer_config={"backend": "weightcast"}``; the plugin
(:mod:`weightcast.client.vllm.plugin`) registered the name. One ``update_weights`` call loads
one whole version, in three steps, on every rank:

1. **stage**: lease the version, verify and read this rank's part into host memory
   (:mod:`.staging`), and check every part against the checkpoint-format shape and dtype vLLM
   recorded for each parameter when it built the model (the layerwise-reload metadata), and
   that every parameter gets one. Nothing in the model is touched.
2. **agree**: the ranks exchange their verdicts over the world CPU group. If any rank refused,
   no rank touches anything and the engine keeps serving the old weights.
3. **apply**: ``inplace`` copies each part into its live parameter (fused blocks byte for
   byte) where the engine keeps checkpoint-format parameters (CUDA, unquantized);
   ``layerwise`` goes through vLLM's layerwise reload with HF-named tensors
   (:mod:`.placement`) where the platform or quantization post-processes weights (CPU
   repacks every linear layer). The ranks agree on the outcome again.

``start_weight_update`` and ``finish_weight_update`` have nothing to do: the whole load runs
inside ``update_weights``, so a driver that dies between two calls never leaves the model
half-prepared.

Three vLLM 0.32 bugs shape this:

* ``MultiprocExecutor.collective_rpc`` raises at the first failed rank it reads and leaves
  the other ranks' replies queued, where they answer the next RPC (every later call is then
  off by one). So when ranks fail, only the last rank raises, with every rank's reason; the
  others log and return. A driver must then call ``finish_weight_update`` (the ranks that
  returned still hold an open session) and ignore its error (the last rank's session closed
  when it raised).
* A layerwise reload post-processes a tied parameter only in its first module; on CPU the
  tied ``lm_head`` keeps a packed copy of the old embedding, so the logits would stay the old
  version's. The backend re-runs the post-processing of every such alias module.
* On CPU, a MoE layer's first post-processing prepacks ``w13_weight`` / ``w2_weight`` for
  its kernel; a reload copies the new, unpacked weights into that storage and never packs
  them again (stock ``load_weights`` under a layerwise reload serves garbage from every MoE
  layer). The backend re-runs the prepacking of every expert module it loaded.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from weightcast.client.engine import REFUSED
from weightcast.client.vllm.inplace import InPlaceCopier
from weightcast.client.vllm.placement import hf_tensors, packed_name
from weightcast.client.vllm.protocol import InitInfo, ResolvedLocation, UpdateInfo, resolve
from weightcast.client.vllm.staging import RankReader, StagedVersion
from weightcast.contract.errors import WeightsError
from weightcast.contract.layout import LAYOUT_HF
from weightcast.contract.model_shape import ModelShape, check_shapes
from weightcast.contract.sharding import ShardKind
from weightcast.runtime.config import Config
from weightcast.runtime.settings import load_config

log = init_logger("vllm.weightcast")  # under vLLM's logger, so it shows in vLLM's log

_KV_CACHE_SCALES = ("q_scale", "k_scale", "v_scale", "prob_scale")
"""An attention layer's optional checkpoint scales under a quantization config."""


class WeightcastInitInfo(InitInfo, WeightTransferInitInfo):
    """``init_info`` of the ``weightcast`` backend (see :class:`InitInfo`)."""


class WeightcastUpdateInfo(UpdateInfo, WeightTransferUpdateInfo):
    """``update_info`` of the ``weightcast`` backend (see :class:`UpdateInfo`)."""


class WeightcastWeightTransferEngine(
    WeightTransferEngine[WeightcastInitInfo, WeightcastUpdateInfo]
):
    """Loads published weightcast versions into this worker's model (one tp rank)."""

    init_info_cls = WeightcastInitInfo
    update_info_cls = WeightcastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.defaults = WeightcastInitInfo()
        self.copier = InPlaceCopier()  # its pinned staging is allocated once, on first use
        self.last_report: dict[str, Any] = {}
        """What the last update did (or why it failed), for :func:`report`."""
        self._reader: RankReader | None = None
        """This rank's reader (Redis, store, host base), kept across updates; closed by
        :meth:`shutdown`, or when an update names another source."""

    def init_transfer_engine(self, init_info: WeightcastInitInfo) -> None:
        self.defaults = init_info

    def start_weight_update(self) -> None:
        """Nothing to prepare: ``update_weights`` stages, agrees and applies in one call."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: ``update_weights`` left the model whole."""

    def shutdown(self) -> None:
        """Close this rank's reader: its Redis connection, store and host base."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one whole version; parsing is part of the guarded stage, so a bad payload is
        refused the way a bad version is (only the last rank raises)."""
        self._load(update_info)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightcastUpdateInfo) -> None:
        self._load(update_info)

    def _load(self, payload: dict[str, Any] | WeightcastUpdateInfo) -> None:
        started = time.perf_counter()
        rank, tp = _tp_rank_and_size()
        what = "the update"
        staged, mode, reason = None, "", None
        try:
            info = (
                payload
                if isinstance(payload, WeightcastUpdateInfo)
                else self.parse_update_info(payload)
            )
            what = f"version {info.version}"
            staged = self._stage(info, rank, tp)
            mode = self._mode(staged)
        except Exception as exc:  # refused: tell the other ranks before anyone touches anything
            reason = f"{type(exc).__name__}: {exc}"
        if self._give_up(f"{what} {REFUSED}", _every_rank(reason)):
            return
        assert staged is not None
        applied = time.perf_counter()
        error = None
        try:
            if mode == "inplace":
                self._apply_in_place(staged)
            else:
                self._apply_layerwise(staged, rank, tp)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if self._give_up(
            f"{what} failed while loading; the engine now holds parts of two versions: "
            "load a whole version again, or restart the engine",
            _every_rank(error),
        ):
            return
        done = time.perf_counter()
        self.last_report = {
            "version": staged.version,
            "layout": staged.layout,
            "mode": mode,
            "rank": rank,
            "tp": tp,
            "tensors": len(staged.parts),
            "bytes": staged.nbytes,
            "via": staged.via,
            "read_bytes": staged.read_bytes,
            "read_s": round(staged.read_seconds, 4),
            "stage_s": round(applied - started, 4),
            "apply_s": round(done - applied, 4),
            "total_s": round(done - started, 4),
        }
        log.info("weightcast: loaded %s", self.last_report)

    def _stage(self, info: WeightcastUpdateInfo, rank: int, tp: int) -> StagedVersion:
        if self.parallel_config.pipeline_parallel_size > 1:
            raise WeightsError("the weightcast backend does not support pipeline parallelism")
        config = load_config()
        source = resolve(info, self.defaults, config)
        staged = self._rank_reader(source, rank, config).stage(
            info.version, tp, self._shape, self._ep(tp)
        )
        self._check_fits(staged, rank, tp)
        return staged

    def _rank_reader(self, source: ResolvedLocation, rank: int, config: Config) -> RankReader:
        """The reader kept for this rank; a new one (the old one closed, its base dropped)
        when an update names another source or ``keep_base`` changed."""
        keep_base = self.defaults.keep_base
        reader = self._reader
        if reader is None or not reader.serves(source, rank, keep_base):
            if reader is not None:
                reader.close()
            self._reader = None
            reader = self._reader = RankReader(source, rank, keep_base, config)
        return reader

    def _ep(self, tp: int) -> int:
        """The engine's expert parallelism: over every tp rank, or none."""
        parallel = self.parallel_config
        if not parallel.enable_expert_parallel:
            return 1
        if parallel.data_parallel_size > 1:
            raise WeightsError(
                "the weightcast backend does not support expert parallelism across "
                "data-parallel ranks"
            )
        return tp

    @cached_property
    def _shape(self) -> ModelShape:
        """The engine's model, from the HF config vLLM loaded once at start."""
        return ModelShape.from_hf_config(self.model_config.hf_config.to_dict())

    def _checkpoint_params(self) -> dict[str, torch.Tensor]:
        """Every loadable parameter as vLLM built it, before any post-processing: meta
        tensors with this rank's checkpoint-format shape and dtype, by qualified name.

        vLLM's layerwise metadata leaves out every ``bias`` (0.32 and 0.33: a bias is built
        after ``create_weights`` and never moved to meta), so a module's live ``bias`` stands
        for its checkpoint shape, in the model's dtype: a CPU engine on AMX keeps it in
        float32 after processing, and its loader converts the checkpoint's bias to that.

        Left out: the KV-cache scales a quantized model's attention layers get
        (``BaseKVCacheMethod``: ``q_scale``, ``k_scale``, ``v_scale``, ``prob_scale``). A
        checkpoint may omit them (vLLM then uses 1.0; the published Qwen3 FP8 checkpoints and
        every FP8 version weightcast writes have none), and vLLM's layerwise reload keeps an
        attention layer's processed scales when nothing is loaded into it."""
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        found: dict[str, torch.Tensor] = {}
        for module_name, module in self.model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is None:
                continue
            recorded = dict(info.restore_metadata[0])
            if isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod):
                for name in _KV_CACHE_SCALES:
                    recorded.pop(name, None)
            bias = module._parameters.get("bias")
            if bias is not None and "bias" not in recorded:
                recorded["bias"] = torch.empty(
                    bias.shape, dtype=self.model_config.dtype, device="meta"
                )
            for name, meta in recorded.items():
                found[f"{module_name}.{name}" if module_name else name] = meta
        if getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            found.pop("lm_head.weight", None)  # the embedding's own parameter
        if not found:
            raise WeightsError("vLLM recorded no parameter metadata for this model")
        return found

    def _check_fits(self, staged: StagedVersion, rank: int, tp: int) -> None:
        """Refuse a version whose parts do not match this rank's parameters exactly."""
        expected = self._checkpoint_params()
        what = f"version {staged.version}"
        if staged.layout == LAYOUT_HF:
            check_shapes({p.name: p.tensor.shape for p in staged.parts}, self._shape)
        covered = set()
        for part in staged.parts:
            name = packed_name(part.name) if staged.layout == LAYOUT_HF else part.name
            meta = expected.get(name)
            if meta is None:
                raise WeightsError(f"{what}: the engine has no parameter {name!r}")
            if part.tensor.dtype != meta.dtype:
                raise WeightsError(
                    f"{what}: {part.name} is {part.tensor.dtype}, the engine runs {meta.dtype} "
                    f"(start vLLM with --dtype {str(part.tensor.dtype).removeprefix('torch.')})"
                )
            if staged.layout != LAYOUT_HF and not _fits(part, meta):
                raise WeightsError(
                    f"{what}: {part.name} rank {rank}/{tp} part is {list(part.tensor.shape)}, "
                    f"the engine's parameter is {list(meta.shape)}"
                )
            covered.add(name)
        missing = sorted(set(expected) - covered)
        if missing:
            raise WeightsError(
                f"{what} has no tensor for the engine's {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            )

    def _mode(self, staged: StagedVersion) -> str:
        """``inplace`` or ``layerwise`` for this engine (see ``protocol.LOAD_MODES``)."""
        wanted = self.defaults.load_mode
        if wanted == "layerwise" or staged.layout == LAYOUT_HF:
            return "layerwise"
        keeps_checkpoint_format = self._keeps_checkpoint_format()
        if wanted == "inplace":
            if not keeps_checkpoint_format:
                raise WeightsError(
                    "load_mode inplace, but this engine post-processes its parameters (their "
                    "shapes differ from the checkpoint's); use auto or layerwise"
                )
            return "inplace"
        from vllm.platforms import current_platform

        # Shapes alone cannot show a platform kept a packed copy elsewhere (CPU does, for
        # the embedding): in place only where parameters are known to be used as they are.
        plain = current_platform.is_cuda() and self.model_config.quantization is None
        return "inplace" if plain and keeps_checkpoint_format else "layerwise"

    def _keeps_checkpoint_format(self) -> bool:
        live = dict(self.model.named_parameters(remove_duplicate=False))
        for name, meta in self._checkpoint_params().items():
            param = live.get(name)
            if param is None or param.shape != meta.shape or param.dtype != meta.dtype:
                return False
        return True

    def _apply_in_place(self, staged: StagedVersion) -> None:
        params = {n: p.data for n, p in self.model.named_parameters(remove_duplicate=False)}
        self.copier.copy(params, ((part.name, part.tensor) for part in staged.parts))

    def _apply_layerwise(self, staged: StagedVersion, rank: int, tp: int) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(hf_tensors(staged.parts, self._shape, rank, tp))
        finally:
            # Always: restores the old tensors of every module nothing was loaded into,
            # processes what was loaded, unwraps the loaders.
            finalize_layerwise_reload(self.model, self.model_config)
            for module in _tied_modules(self.model):
                module.quant_method.process_weights_after_loading(module)
        missing = sorted(set(self._checkpoint_params()) - set(loaded or ()))
        if missing:
            raise RuntimeError(f"vLLM's loaders did not load {', '.join(missing[:4])}")
        for module in _cpu_prepacked_experts(self.model):
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)

    def _give_up(self, message: str, verdicts: list[str | None]) -> bool:
        """True when any rank failed. Only the last rank raises (see the module docstring)."""
        if not any(verdicts):
            return False
        if len(verdicts) == 1:
            detail = verdicts[0]
        else:
            detail = "; ".join(f"rank {r}: {v or 'ok'}" for r, v in enumerate(verdicts))
        self.last_report = {"failed": message, "ranks": verdicts}
        if _is_last_rank():
            raise WeightsError(f"{message}: {detail}")
        log.warning("weightcast: %s: %s", message, detail)
        return True


def _fits(part: Any, meta: torch.Tensor) -> bool:
    """A rank part fits its parameter: the same shape, or for the vocabulary the rank's
    rows without the padding vLLM adds after them."""
    got, want = tuple(part.tensor.shape), tuple(meta.shape)
    if part.shard.kind == ShardKind.VOCAB_PARALLEL:
        return got[1:] == want[1:] and got[0] <= want[0]
    return got == want


def _tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _every_rank(verdict: str | None) -> list[str | None]:
    """Every rank's verdict (None: fine), exchanged over the world CPU (gloo) group."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [verdict]
    gathered: list[str | None] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, verdict, group=group.cpu_group)
    return gathered


def _is_last_rank() -> bool:
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    return group.rank_in_group == group.world_size - 1


def _tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with a quantization method whose parameter is an earlier module's (a tied
    ``lm_head``): vLLM's layerwise reload never post-processes them again."""
    owner: dict[int, torch.nn.Module] = {}
    tied: list[torch.nn.Module] = []
    for module in model.modules():
        for param in module.parameters(recurse=False):
            first = owner.setdefault(id(param), module)
            if first is not module and module not in tied and hasattr(module, "quant_method"):
                tied.append(module)
    return tied


def _cpu_prepacked_experts(model: torch.nn.Module) -> list[Any]:
    """MoE expert modules whose kernel keeps a CPU-prepacked copy of the weights (see the
    module docstring); none off CPU, where a reload's in-place copy is what the kernel reads."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    return [
        module
        for module in model.modules()
        if isinstance(module, RoutedExperts) and module.quant_method.moe_kernel is not None
    ]


def report(worker: Any) -> dict[str, Any]:
    """The last update's report of one worker: ``llm.collective_rpc(report)`` (vLLM sends the
    function by pickle only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return dict(getattr(engine, "last_report", {}))
