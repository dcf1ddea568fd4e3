"""The rollout batch format: one stream entry is one micro-batch.

An entry has two fields: ``batch``, the bytes of ``safetensors.torch.save`` of a dict of
tensors, and ``meta``, UTF-8 JSON with at least ``policy_version`` and ``producer``. No pickle
crosses the wire. :func:`validate_tensors` is the one place the tensor rules live; producers
call it before sending and the trainer after receiving, so both give the same reason.

Values are bounded as well as finite, so that the trainer's loss is finite for every batch
this module admits: log-probabilities are ``<= 0`` (they are logarithms of probabilities)
and advantages lie within ``[-MAX_ABS_ADVANTAGE, MAX_ABS_ADVANTAGE]``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from weightcast.contract.errors import InvalidBatch

BATCH_FIELD = "batch"
META_FIELD = "meta"

REQUIRED_TENSORS = ("input_ids", "loss_mask", "advantages")
OPTIONAL_TENSORS = ("old_logprobs", "ref_logprobs")

_ID_DTYPES = (torch.int32, torch.int64)
_MASK_DTYPES = (torch.bool, torch.uint8, torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

MAX_ABS_ADVANTAGE = 1e4
"""Largest advantage magnitude admitted. Normalised GRPO advantages stay below the square
root of the group size, and raw rewards of real tasks far below this; a larger value is
almost surely a producer bug (a division by a near-zero standard deviation). With it, the
loss per token is at most ``dual_clip * MAX_ABS_ADVANTAGE`` (1e6 at the largest dual_clip,
100), far inside float32 and bfloat16."""

MAX_POLICY_VERSION = 2**63 - 1
"""Versions are Redis integers (signed 64 bits)."""


@dataclass(frozen=True)
class BatchLimits:
    """What the receiving model accepts; ``None`` skips that check (producers may not know)."""

    vocab_size: int | None = None
    max_seq_len: int | None = None
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass
class RolloutBatch:
    """A validated micro-batch, with per-token tensors all ``[B, T]`` on the CPU."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        return int(self.meta["policy_version"])

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def encode_batch(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    limits: BatchLimits = BatchLimits(),
) -> dict[str, bytes]:
    """Stream-entry fields for ``tensors`` and ``meta``; raises :class:`InvalidBatch`."""
    validate_meta(meta)
    validate_tensors(tensors, limits)
    blob = save_safetensors({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
    return {BATCH_FIELD: blob, META_FIELD: json.dumps(dict(meta)).encode()}


def decode_batch(fields: Mapping[bytes | str, bytes], limits: BatchLimits) -> RolloutBatch:
    """Parse and validate one stream entry; raises :class:`InvalidBatch` with a reason.

    Whatever the parsers raise on hostile bytes (``RecursionError`` from deeply nested JSON,
    ``MemoryError``, ``ValueError`` from a 5000-digit number...) is an invalid batch too:
    the entry is at fault, never the process reading it.
    """
    try:
        return _decode(fields, limits)
    except InvalidBatch:
        raise
    except Exception as exc:
        text = str(exc)
        text = text if len(text) <= 200 else text[:200] + "..."
        raise InvalidBatch(f"entry cannot be decoded: {type(exc).__name__}: {text}") from None


def _decode(fields: Mapping[bytes | str, bytes], limits: BatchLimits) -> RolloutBatch:
    named = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
    for name in (BATCH_FIELD, META_FIELD):
        if name not in named:
            raise InvalidBatch(f"missing field {name!r} (fields: {sorted(named)})")
    blob = named[BATCH_FIELD]
    if len(blob) > limits.max_bytes:
        raise InvalidBatch(f"batch is {len(blob)} bytes, over the limit of {limits.max_bytes}")
    try:
        meta = json.loads(named[META_FIELD])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidBatch(f"meta is not UTF-8 JSON: {exc}") from None
    validate_meta(meta)
    try:
        tensors = load_safetensors(blob)
    except Exception as exc:  # safetensors raises its own error types for malformed input
        raise InvalidBatch(f"batch is not a safetensors blob: {exc}") from None
    validate_tensors(tensors, limits)
    batch_size, seq_len = tensors["input_ids"].shape
    advantages = tensors["advantages"].float()
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand(batch_size, seq_len)
    return RolloutBatch(
        input_ids=tensors["input_ids"].long(),
        loss_mask=tensors["loss_mask"].float(),
        advantages=advantages.contiguous(),
        old_logprobs=_as_float(tensors.get("old_logprobs")),
        ref_logprobs=_as_float(tensors.get("ref_logprobs")),
        meta=meta,
    )


def validate_meta(meta: Any) -> None:
    """Check the JSON meta: an object with an int ``policy_version`` and a str ``producer``."""
    if not isinstance(meta, Mapping):
        raise InvalidBatch(f"meta must be a JSON object, got {type(meta).__name__}")
    version = meta.get("policy_version")
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or not 0 <= version <= MAX_POLICY_VERSION
    ):
        raise InvalidBatch(
            f"meta.policy_version must be an int >= 0 and < 2**63, got {_short(version)}"
        )
    if not isinstance(meta.get("producer"), str):
        raise InvalidBatch(f"meta.producer must be a string, got {_short(meta.get('producer'))}")


def validate_tensors(tensors: Mapping[str, torch.Tensor], limits: BatchLimits) -> None:
    """Check names, dtypes, shapes and values of a batch against the contract."""
    missing = [n for n in REQUIRED_TENSORS if n not in tensors]
    if missing:
        raise InvalidBatch(f"missing tensor(s) {missing}; a batch needs {list(REQUIRED_TENSORS)}")
    unknown = sorted(set(tensors) - set(REQUIRED_TENSORS) - set(OPTIONAL_TENSORS))
    if unknown:
        raise InvalidBatch(
            f"unknown tensor(s) {unknown}; allowed: {list(REQUIRED_TENSORS + OPTIONAL_TENSORS)}"
        )
    input_ids = tensors["input_ids"]
    _expect_dtype("input_ids", input_ids, _ID_DTYPES)
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise InvalidBatch(
            f"input_ids must be a non-empty [B, T] tensor, got {list(input_ids.shape)}"
        )
    batch_size, seq_len = input_ids.shape
    if limits.max_seq_len is not None and seq_len > limits.max_seq_len:
        raise InvalidBatch(f"sequence length {seq_len} exceeds the maximum of {limits.max_seq_len}")
    if input_ids.min() < 0:
        raise InvalidBatch(f"input_ids has negative id {int(input_ids.min())}")
    if limits.vocab_size is not None and input_ids.max() >= limits.vocab_size:
        raise InvalidBatch(
            f"input_ids has id {int(input_ids.max())}, not below vocab size {limits.vocab_size}"
        )

    loss_mask = tensors["loss_mask"]
    _expect_dtype("loss_mask", loss_mask, _MASK_DTYPES)
    _expect_shape("loss_mask", loss_mask, (batch_size, seq_len))
    mask = loss_mask.float()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InvalidBatch("loss_mask must hold only 0 and 1")
    if not bool(mask[:, 1:].any()):
        raise InvalidBatch("loss_mask selects no trainable token (position 0 is never trained)")

    advantages = tensors["advantages"]
    _expect_dtype("advantages", advantages, _FLOAT_DTYPES)
    if list(advantages.shape) not in ([batch_size], [batch_size, seq_len]):
        raise InvalidBatch(
            f"advantages must be [B] or [B, T] = [{batch_size}] or [{batch_size}, {seq_len}], "
            f"got {list(advantages.shape)}"
        )
    _expect_finite("advantages", advantages)
    largest = advantages.float().abs().max().item()
    if largest > MAX_ABS_ADVANTAGE:
        raise InvalidBatch(
            f"advantages holds {largest:g}, beyond the bound of +-{MAX_ABS_ADVANTAGE:g} "
            "(normalise them; such a value usually comes from dividing by a near-zero std)"
        )

    for name in OPTIONAL_TENSORS:
        if name in tensors:
            _expect_dtype(name, tensors[name], _FLOAT_DTYPES)
            _expect_shape(name, tensors[name], (batch_size, seq_len))
            _expect_finite(name, tensors[name])
            highest = tensors[name].float().max().item()
            if highest > 0:
                raise InvalidBatch(
                    f"{name} holds {highest:g}; log-probabilities must be <= 0 "
                    "(use 0 at positions without one)"
                )


def _short(value: Any) -> str:
    """``repr(value)``, cut short: a hostile entry must not make the reason huge."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} characters)"


def _as_float(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


def _expect_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InvalidBatch(
            f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; allowed: {names}"
        )


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise InvalidBatch(
            f"{name} must have shape {list(shape)} like input_ids, got {list(tensor.shape)}"
        )


def _expect_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor.float()).all()):
        bad = tensor.float()[~torch.isfinite(tensor.float())][0].item()
        raise InvalidBatch(f"{name} holds a non-finite value ({'nan' if math.isnan(bad) else bad})")
