"""The backend's in-place load, on tensors shaped like vLLM's parameters (no vLLM).

A rank's fused parts land byte for byte in the leading rows of their parameters; the
vocabulary's padding rows become zero; no parameter changes storage (CUDA graphs captured on
them stay valid); a tied ``lm_head`` stays the embedding's tensor. The ``gpu`` tests copy
into CUDA parameters through the pinned staging ring and replay a captured CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightcast.client.vllm.inplace import InPlaceCopier
from weightcast.contract.fusion import assemble, plan_vllm_fused
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import ShardKind

from helpers.models import hf_state, rank_part, shape_of

PADDING = 6
"""Rows vLLM adds after a rank's vocabulary (it pads the vocabulary to a multiple of 64)."""

TIED = dataclasses.replace(shape_of(4, 2, 8, hidden=16, inter=32), vocab_size=100)
UNTIED_BIASED = dataclasses.replace(
    shape_of(4, 2, 8, hidden=16, inter=32, tied=False, bias=True), vocab_size=100
)
CASES = [(TIED, 1), (TIED, 2), (UNTIED_BIASED, 2)]


def rank_parts(
    shape: ModelShape, tp: int, rank: int, seed: int
) -> dict[str, tuple[torch.Tensor, ShardKind]]:
    """One rank's part of a version (fused tensors, as the reader returns them) with each
    tensor's shard kind; another version for each ``seed``."""
    state = {name: t + seed for name, t in hf_state(shape, torch.bfloat16).items()}
    plan = plan_vllm_fused({n: t.shape[0] for n, t in state.items()}, shape, tp)
    return {
        p.name: (rank_part(assemble(p, state), p.shard, rank, tp).clone(), p.shard.kind)
        for p in plan
    }


def engine_params(
    parts: dict[str, tuple[torch.Tensor, ShardKind]], tied: bool, device: str
) -> dict[str, torch.Tensor]:
    """A rank's parameters as vLLM holds them: garbage-filled, the vocabulary-parallel ones
    padded, a tied ``lm_head`` the embedding's own tensor (as named_parameters lists it)."""
    params = {}
    for name, (part, kind) in parts.items():
        rows = part.shape[0] + (PADDING if kind == ShardKind.VOCAB_PARALLEL else 0)
        params[name] = torch.full((rows, *part.shape[1:]), 7.0, dtype=part.dtype, device=device)
    if tied:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    return params


def load_and_check(
    copier: InPlaceCopier, shape: ModelShape, tp: int, device: str, versions: int = 2
) -> dict[str, torch.Tensor]:
    """Copy ``versions`` versions of every rank into its parameters and check each."""
    for rank in range(tp):
        params = engine_params(rank_parts(shape, tp, rank, 0), shape.tie_word_embeddings, device)
        pointers = {name: p.data_ptr() for name, p in params.items()}
        for seed in range(versions):
            parts = rank_parts(shape, tp, rank, seed)
            copied = copier.copy(params, ((n, t) for n, (t, _) in parts.items()))
            assert copied == sum(t.numel() * t.element_size() for t, _ in parts.values())
            assert {name: p.data_ptr() for name, p in params.items()} == pointers
            for name, (part, _) in parts.items():
                param = params[name].cpu()
                assert torch.equal(param[: len(part)], part), (name, rank, seed)
                assert not param[len(part) :].any(), f"{name}: padding rows not zero"
            if shape.tie_word_embeddings:
                assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    return params


@pytest.mark.parametrize(("shape", "tp"), CASES)
def test_parts_land_in_place_padding_is_zeroed_and_a_tied_head_stays_tied(
    shape: ModelShape, tp: int
) -> None:
    load_and_check(InPlaceCopier(), shape, tp, "cpu")


def test_a_part_that_does_not_fit_is_refused_naming_it() -> None:
    params = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    copier = InPlaceCopier()
    with pytest.raises(ValueError, match=r"w: the part is torch\.float32"):
        copier.copy(params, [("w", torch.zeros(4, 3))])
    with pytest.raises(ValueError, match=r"w: a part of \[5, 3\] does not fit"):
        copier.copy(params, [("w", torch.zeros(5, 3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match=r"w: a part of \[4, 2\] does not fit"):
        copier.copy(params, [("w", torch.zeros(4, 2, dtype=torch.bfloat16))])
    with pytest.raises(KeyError, match="nope"):
        copier.copy(params, [("nope", torch.zeros(1))])
    assert not params["w"].any()


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "tp"), CASES)
def test_on_cuda_parts_go_through_pinned_staging_allocated_once(shape: ModelShape, tp: int) -> None:
    copier = InPlaceCopier(slot_bytes=512, slots=2)  # parts span many slots: the ring turns
    load_and_check(copier, shape, tp, "cuda")
    assert copier.staging_allocations == 1
    assert all(slot.is_pinned() for slot in copier._staging)


@pytest.mark.gpu
def test_a_cuda_graph_captured_before_the_update_computes_with_the_new_weights() -> None:
    parts = rank_parts(UNTIED_BIASED, 2, 1, 0)
    params = engine_params(parts, tied=False, device="cuda")
    copier = InPlaceCopier()
    copier.copy(params, ((n, t) for n, (t, _) in parts.items()))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    x = torch.randn(3, params[name].shape[1], dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = x @ params[name].T  # warm-up on the side stream, as capture needs
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = x @ params[name].T
    new = rank_parts(UNTIED_BIASED, 2, 1, 5)
    copier.copy(params, ((n, t) for n, (t, _) in new.items()))
    graph.replay()
    torch.cuda.synchronize()
    expected = x @ new[name][0].cuda().T
    assert torch.equal(out, expected)
