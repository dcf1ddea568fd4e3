"""The batch contract: what a producer may send and the reasons a batch is refused."""

from __future__ import annotations

import json

import pytest
import torch

from weightcast.contract.codec import (
    BATCH_FIELD,
    META_FIELD,
    BatchLimits,
    InvalidBatch,
    decode_batch,
    encode_batch,
)

META = {"policy_version": 3, "producer": "test"}
LIMITS = BatchLimits(vocab_size=100, max_seq_len=16)


def good(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = {
        "input_ids": torch.randint(0, 100, (2, 8)),
        "loss_mask": torch.tensor([[0] * 4 + [1] * 4, [0] * 6 + [1] * 2], dtype=torch.bool),
        "advantages": torch.tensor([0.5, -1.0]),
    }
    tensors.update(overrides)
    return tensors


def test_round_trip_keeps_values_and_broadcasts_sequence_advantages() -> None:
    tensors = good(old_logprobs=torch.full((2, 8), -1.5))
    batch = decode_batch(encode_batch(tensors, META), LIMITS)
    assert torch.equal(batch.input_ids, tensors["input_ids"])
    assert batch.input_ids.dtype == torch.int64
    assert batch.advantages.shape == (2, 8)
    assert torch.equal(batch.advantages[1], torch.full((8,), -1.0))
    assert torch.equal(batch.loss_mask, tensors["loss_mask"].float())
    assert batch.old_logprobs is not None and batch.ref_logprobs is None
    assert batch.policy_version == 3 and batch.meta["producer"] == "test"


def test_encoded_fields_are_safetensors_and_json() -> None:
    fields = encode_batch(good(), META)
    assert json.loads(fields[META_FIELD]) == META
    header_len = int.from_bytes(fields[BATCH_FIELD][:8], "little")
    assert "input_ids" in json.loads(fields[BATCH_FIELD][8 : 8 + header_len])


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        (good(input_ids=torch.randint(0, 100, (2, 20))), "sequence length 20 exceeds"),
        (good(input_ids=torch.full((2, 8), 100)), "not below vocab size 100"),
        (good(input_ids=torch.full((2, 8), -1)), "negative id"),
        (good(input_ids=torch.zeros(2, 8)), "input_ids has dtype float32"),
        (good(loss_mask=torch.ones(2, 7, dtype=torch.bool)), "loss_mask must have shape [2, 8]"),
        (good(loss_mask=torch.full((2, 8), 2, dtype=torch.uint8)), "only 0 and 1"),
        (
            good(loss_mask=torch.tensor([[1] + [0] * 7] * 2, dtype=torch.uint8)),
            "selects no trainable token",
        ),
        (good(advantages=torch.tensor([float("nan"), 0.0])), "advantages holds a non-finite"),
        (good(advantages=torch.zeros(3)), "advantages must be [B] or [B, T]"),
        (good(ref_logprobs=torch.zeros(2, 8, dtype=torch.int64)), "ref_logprobs has dtype"),
        (good(old_logprobs=torch.full((2, 8), float("inf"))), "old_logprobs holds a non-finite"),
        (good(old_logprobs=torch.full((2, 8), 0.5)), "old_logprobs holds 0.5; log-probabilities"),
        (good(ref_logprobs=torch.full((2, 8), 1e-3)), "ref_logprobs holds 0.001; log-probab"),
        (good(advantages=torch.tensor([3e38, 0.0])), "advantages holds 3e+38, beyond the bound"),
        (good(advantages=torch.tensor([0.0, -10001.0])), "advantages holds 10001, beyond"),
        (good(reward=torch.zeros(2)), "unknown tensor(s) ['reward']"),
        ({"input_ids": torch.zeros(2, 8, dtype=torch.int64)}, "missing tensor(s)"),
    ],
)
def test_bad_tensors_are_refused_with_a_reason(tensors: dict, reason: str) -> None:
    with pytest.raises(InvalidBatch) as refused:
        encode_batch(tensors, META, LIMITS)
    assert reason in refused.value.reason
    # The trainer, decoding what a careless producer sent anyway, gives the same reason.
    with pytest.raises(InvalidBatch) as decoded:
        decode_batch(_raw_fields(tensors, META), LIMITS)
    assert decoded.value.reason == refused.value.reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({META_FIELD: b"{}"}, "missing field 'batch'"),
        ({BATCH_FIELD: b"x", META_FIELD: b"not json"}, "meta is not UTF-8 JSON"),
        ({BATCH_FIELD: b"x", META_FIELD: b"[1]"}, "meta must be a JSON object"),
        (
            {BATCH_FIELD: b"x", META_FIELD: b'{"policy_version": "3", "producer": "p"}'},
            "meta.policy_version must be an int",
        ),
        ({BATCH_FIELD: b"x", META_FIELD: b'{"policy_version": 1}'}, "meta.producer must be"),
        (
            {BATCH_FIELD: b"x", META_FIELD: b'{"policy_version": 9223372036854775808}'},
            "meta.policy_version must be an int >= 0 and < 2**63, got 9223372036854775808",
        ),
        (
            {BATCH_FIELD: b"x", META_FIELD: b"[" * 100_000 + b"]" * 100_000},
            "entry cannot be decoded: RecursionError: maximum recursion depth exceeded",
        ),
        (
            {BATCH_FIELD: b"x", META_FIELD: b'{"policy_version": ' + b"9" * 5000 + b"}"},
            "entry cannot be decoded: ValueError: Exceeds the limit (4300 digits)",
        ),
        (
            {BATCH_FIELD: b"garbage bytes", META_FIELD: json.dumps(META).encode()},
            "not a safetensors blob",
        ),
    ],
)
def test_bad_fields_are_refused_with_a_reason(fields: dict, reason: str) -> None:
    with pytest.raises(InvalidBatch) as refused:
        decode_batch(fields, LIMITS)
    assert reason in refused.value.reason


def test_the_extremes_the_bounds_allow_are_admitted() -> None:
    tensors = good(
        advantages=torch.tensor([1e4, -1e4]),
        old_logprobs=torch.full((2, 8), -3e38),
        ref_logprobs=torch.zeros(2, 8),
    )
    batch = decode_batch(encode_batch(tensors, META), LIMITS)
    assert batch.advantages.abs().max() == 1e4


def test_whatever_a_parser_raises_is_an_invalid_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryError (say, from a size a header declares) or anything else: the entry is bad."""

    fields = encode_batch(good(), META)

    def out_of_memory(*_args: object) -> None:
        raise MemoryError("cannot allocate 2**40 bytes")

    monkeypatch.setattr("weightcast.contract.codec.validate_tensors", out_of_memory)
    with pytest.raises(InvalidBatch) as refused:
        decode_batch(fields, LIMITS)
    assert (
        refused.value.reason == "entry cannot be decoded: MemoryError: cannot allocate 2**40 bytes"
    )


def test_a_long_reason_is_cut_short() -> None:
    meta = json.dumps({"policy_version": 1, "producer": ["x" * 10_000]}).encode()
    with pytest.raises(InvalidBatch) as refused:
        decode_batch({BATCH_FIELD: b"x", META_FIELD: meta}, LIMITS)
    assert len(refused.value.reason) < 200 and "characters)" in refused.value.reason


def test_oversize_batch_is_refused_before_parsing() -> None:
    fields = encode_batch(good(), META)
    with pytest.raises(InvalidBatch, match="over the limit of 100"):
        decode_batch(fields, BatchLimits(max_bytes=100))


def _raw_fields(tensors: dict, meta: dict) -> dict[bytes, bytes]:
    from safetensors.torch import save

    return {BATCH_FIELD.encode(): save(tensors), META_FIELD.encode(): json.dumps(meta).encode()}
