"""Starting a run from a Hugging Face checkpoint directory (``trainer.init_from``).

The directory is what ``transformers``' ``save_pretrained`` writes for a Qwen3, dense
(``Qwen3ForCausalLM``) or a mixture of experts (``Qwen3MoeForCausalLM``, one tensor per
expert, ``mlp.experts.<e>.{gate,up,down}_proj.weight``): ``config.json``, then
``model.safetensors`` or shards listed by ``model.safetensors.index.json``, in bf16, fp16
or fp32. :func:`inspect_start` reads and
checks all of it before anything is built or written: the model's shape comes from
``config.json`` (:func:`model_args_from_hf`, pure), every file the index names must exist,
every safetensors header must be whole and agree with its file, and every tensor the model
needs must be there with the shape the config implies and a float dtype. A bad start is a
:class:`ConfigError` naming the file, so ``weightcast trainer`` exits 2 with one line.

:func:`load_start` then fills the model through torchtitan's Qwen3 state-dict adapter and
DCP's ``HuggingFaceStorageReader``: under FSDP each rank reads only the slices of its own
shards (``safe_open(...).get_slice``), straight into its parameters, cast to their dtype;
no rank holds a second full copy. torchtitan holds an MoE layer's experts as three
``[experts, ...]`` tensors (``moe.experts.w1/w2/w3``); the adapter splits them into HF's
per-expert names for the read (under FSDP, each rank the experts of its shard) and stacks
them again.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from weightcast.contract.errors import ConfigError, LayoutError
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import CONFIG_NAME
from weightcast.contract.tensorfile import HeaderError, TensorSpan, read_header
from weightcast.contract.untrusted import json_object
from weightcast_trainer.model import TiedQwen3Model, qwen3_args

ARCHITECTURE = "Qwen3ForCausalLM"
MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPES = {ARCHITECTURE: "qwen3", MOE_ARCHITECTURE: "qwen3_moe"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
START_DTYPES = ("BF16", "F16", "F32")
"""The dtypes a starting checkpoint may hold (safetensors' names)."""

HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0}
MAX_POSITIONS = 32_768
"""What ``transformers``' ``Qwen3Config`` assumes when ``config.json`` leaves a field out."""


@dataclasses.dataclass(frozen=True)
class StartCheckpoint:
    """A checked starting checkpoint: where it is, its config and the model it makes."""

    path: Path
    hf_config: dict[str, Any]
    """``config.json`` as the directory has it (snapshots of the run carry it on)."""
    args: Qwen3ModelArgs
    tensors: Mapping[str, TensorSpan]
    """Every tensor of the checkpoint by HF name (its file is in ``files``)."""
    files: Mapping[str, str]
    """The file that holds each tensor, relative to ``path``."""


def model_args_from_hf(config: Mapping[str, Any], where: str) -> Qwen3ModelArgs:
    """torchtitan's Qwen3 args for a Qwen3 or Qwen3-MoE ``config.json`` (``where`` names it).

    Every field is checked for its type and bounds; what torchtitan's Qwen3 cannot build
    (attention biases, rope scaling, sliding windows, HF's router auxiliary loss, another
    architecture) is refused rather than ignored.
    """
    architectures = config.get("architectures")
    only = architectures[0] if isinstance(architectures, list) and len(architectures) == 1 else 0
    model_type = MODEL_TYPES.get(only) if isinstance(only, str) else None
    if model_type is None:
        raise ConfigError(
            f"{where}: architectures is {architectures!r}; --init-from takes a "
            f"{ARCHITECTURE} or {MOE_ARCHITECTURE} checkpoint"
        )
    if config.get("model_type", model_type) != model_type:
        raise ConfigError(
            f"{where}: model_type is {config.get('model_type')!r}, not {model_type!r}"
        )
    for name, allowed in (
        ("attention_bias", False),
        ("use_sliding_window", False),
        ("rope_scaling", None),
        ("hidden_act", "silu"),
    ):
        if config.get(name, allowed) != allowed:
            raise ConfigError(
                f"{where}: {name} is {config[name]!r}; torchtitan's Qwen3 supports only {allowed!r}"
            )
    try:
        # the layout's fields, checked once; the architecture makes it a MoE when the config
        # names no model_type (ModelShape then gives its fields Qwen3MoeConfig's defaults)
        shape = ModelShape.from_hf_config({"model_type": model_type, **config})
    except LayoutError as exc:
        raise ConfigError(f"{where}: {str(exc).removeprefix('config.json: ')}") from None
    if shape.num_heads % shape.num_kv_heads:
        raise ConfigError(
            f"{where}: num_attention_heads {shape.num_heads} is not a multiple of "
            f"num_key_value_heads {shape.num_kv_heads}"
        )
    if model_type == "qwen3_moe":
        _check_router(config, where)
    else:  # a dense architecture is built dense, whatever expert fields its config has
        shape = dataclasses.replace(shape, num_experts=0)
    return qwen3_args(
        shape,
        norm_eps=_positive(config, "rms_norm_eps", where),
        rope_theta=_rope_theta(config, where),
        max_seq_len=_max_positions(config, where),
        eos_id=_eos(config, where),
    )


def _check_router(config: Mapping[str, Any], where: str) -> None:
    """Refuse ``output_router_logits``: torchtitan does not compute HF's auxiliary loss
    (``router_aux_loss_coef`` only weighs that loss, so it is unused without it). The
    experts' other fields :meth:`ModelShape.from_hf_config` reads and checks."""
    router_logits = config.get("output_router_logits", False)
    if type(router_logits) is not bool:
        raise ConfigError(f"{where}: output_router_logits is {router_logits!r}, not true or false")
    if router_logits:
        raise ConfigError(
            f"{where}: output_router_logits is true: torchtitan 0.2.0's Qwen3 MoE trains "
            "without HF's router auxiliary loss (only false is supported)"
        )


def inspect_start(path: Path) -> StartCheckpoint:
    """Read and check the checkpoint in ``path``; raises :class:`ConfigError` naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"trainer.init_from {path}: no such directory")
    config_path = path / CONFIG_NAME
    config = json_object(_read(config_path), str(config_path), ConfigError)
    args = model_args_from_hf(config, str(config_path))
    files, names = _tensor_files(path)
    tensors: dict[str, TensorSpan] = {}
    for name in names:
        for span in _header(path / name).tensors:
            if files.get(span.name, name) != name:
                raise ConfigError(
                    f"{path / name}: holds {span.name}, which {INDEX_FILE} places in "
                    f"{files[span.name]}"
                )
            tensors[span.name] = span
            files[span.name] = name
    _check_tensors(tensors, files, path, args)
    return StartCheckpoint(path.absolute(), config, args, tensors, files)


def start_config(config: Mapping[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` of the run's snapshots: the checkpoint's own, in ``dtype``."""
    dtypes = {"torch_dtype": dtype} | ({"dtype": dtype} if "dtype" in config else {})
    return {**config, **dtypes}


def check_model_flag(model: str, flavor: Qwen3ModelArgs, start: StartCheckpoint) -> None:
    """Refuse a ``--model`` flavor whose shape contradicts the checkpoint's ``config.json``."""
    ours, theirs = _shape_fields(flavor), _shape_fields(start.args)
    differ = [k for k in dict.fromkeys([*ours, *theirs]) if ours.get(k) != theirs.get(k)]
    if differ:
        given = ", ".join(f"{k}={ours.get(k)}" for k in differ)
        found = ", ".join(f"{k}={theirs.get(k)}" for k in differ)
        raise ConfigError(
            f"trainer.model {model!r} ({given}) contradicts {start.path / CONFIG_NAME} "
            f"({found}); leave --model out to train the checkpoint's own shape"
        )


def _shape_fields(args: Qwen3ModelArgs) -> dict[str, Any]:
    """The fields of ``args`` that ``config.json`` fixes (the experts' only for an MoE)."""
    keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim")
    fields = {k: getattr(args, k) for k in (*keys, "enable_weight_tying", "moe_enabled")}
    if args.moe_enabled:
        moe = args.moe_args
        fields |= {"moe_inter_dim": args.moe_inter_dim, "num_experts": moe.num_experts}
        fields |= {"top_k": moe.top_k, "route_norm": moe.route_norm}
        fields |= {"dense_layers": getattr(args, "dense_layers", ())}
    return fields


def load_start(model: torch.nn.Module, start: StartCheckpoint) -> None:
    """Fill ``model`` (built from ``start.args``, FSDP or not) with the checkpoint's weights."""
    adapter = Qwen3StateDictAdapter(start.args, None)
    hf_state = adapter.to_hf(model.state_dict())
    if start.args.enable_weight_tying:
        hf_state.pop("lm_head.weight", None)  # one parameter, loaded as embed_tokens
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(start.path)))
    state = adapter.from_hf(hf_state)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"output.weight"} if start.args.enable_weight_tying else set()
    if unexpected or set(missing) - tied:
        raise ConfigError(
            f"{start.path}: the checkpoint did not fill the model (missing {missing}, "
            f"unexpected {unexpected})"
        )


def expected_tensors(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every HF tensor torchtitan's Qwen3 with ``args`` holds, with its shape (built on the
    meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = TiedQwen3Model(args)
    names = Qwen3StateDictAdapter(args, None).to_hf(model.state_dict())
    if args.enable_weight_tying:
        names.pop("lm_head.weight", None)
    return {name: tuple(tensor.shape) for name, tensor in names.items()}


def _check_tensors(
    tensors: Mapping[str, TensorSpan], files: Mapping[str, str], path: Path, args: Qwen3ModelArgs
) -> None:
    expected = expected_tensors(args)
    for name, shape in expected.items():
        span = tensors.get(name)
        if span is None:
            raise ConfigError(f"{path}: {name} is missing from the checkpoint's files")
        where = path / files[name]
        if span.shape != shape:
            raise ConfigError(
                f"{where}: {name} has shape {list(span.shape)}; {CONFIG_NAME} implies {list(shape)}"
            )
        if span.dtype not in START_DTYPES:
            raise ConfigError(
                f"{where}: {name} is {span.dtype}; a starting checkpoint holds "
                f"{', '.join(START_DTYPES)}"
            )
    tied_head = {"lm_head.weight"} if args.enable_weight_tying else set()
    extra = sorted(set(tensors) - set(expected) - tied_head)
    if extra:
        raise ConfigError(
            f"{path / files[extra[0]]}: {extra[0]} is not a tensor of the model "
            f"{CONFIG_NAME} describes ({len(extra)} such); it would be ignored"
        )


def _tensor_files(path: Path) -> tuple[dict[str, str], list[str]]:
    """Tensor name -> file as the index places them (none for a single
    ``model.safetensors``), and the files to read."""
    index_path = path / INDEX_FILE
    on_disk = {p.name for p in path.glob("*.safetensors")}
    if not index_path.exists():
        if SINGLE_FILE not in on_disk:
            raise ConfigError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} is there")
        if on_disk != {SINGLE_FILE}:
            raise ConfigError(
                f"{path}: {sorted(on_disk - {SINGLE_FILE})[0]} is there beside {SINGLE_FILE} "
                f"and no {INDEX_FILE} says which to read"
            )
        return {}, [SINGLE_FILE]
    index = json_object(_read(index_path), str(index_path), ConfigError)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ConfigError(f"{index_path}: weight_map must map tensor names to file names")
    for name in sorted(set(weight_map.values())):
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise ConfigError(f"{index_path}: {name!r} is not a .safetensors file in {path}")
        if name not in on_disk:
            raise ConfigError(f"{index_path}: names {name}, which is not in {path}")
    stray = on_disk - set(weight_map.values())
    if stray:
        raise ConfigError(
            f"{path / sorted(stray)[0]}: not in {INDEX_FILE}; DCP's reader would read it too"
        )
    return dict(weight_map), sorted(set(weight_map.values()))


def _header(file: Path) -> Any:
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError(f"{file}: {exc.strerror}") from None
    try:
        return read_header(fd, str(file))
    except HeaderError as exc:
        raise ConfigError(f"{exc} (truncated or not a safetensors file)") from None
    finally:
        os.close(fd)


def _read(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{file}: {exc.strerror or exc}") from None


def _max_positions(config: Mapping[str, Any], where: str) -> int:
    value = config.get("max_position_embeddings", MAX_POSITIONS)
    if type(value) is not int or value < 1:
        raise ConfigError(
            f"{where}: max_position_embeddings must be a positive integer, got {value!r}"
        )
    return value


def _positive(config: Mapping[str, Any], name: str, where: str) -> float:
    value = config.get(name, HF_DEFAULTS[name])
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {name} must be finite, got {value!r}")
    return float(value)


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    """``rope_theta`` at the top (transformers 4) or in ``rope_parameters`` (5)."""
    rope = config.get("rope_parameters")
    if rope is None:
        return _positive(config, "rope_theta", where)
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{where}: rope_parameters {rope!r}: torchtitan's Qwen3 supports only the "
            "default rope (rope_type 'default')"
        )
    return _positive(rope, "rope_theta", where)


def _eos(config: Mapping[str, Any], where: str) -> int:
    """The end-of-sequence id (the first, when ``config.json`` lists several; torchtitan's
    default when it names none: only flex attention's document masking reads it)."""
    value = config.get("eos_token_id")
    if value is None:
        return Qwen3ModelArgs.eos_id
    first = value[0] if isinstance(value, list) and value else value
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ConfigError(f"{where}: eos_token_id must be a token id, got {value!r}")
    return first
