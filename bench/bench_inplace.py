"""The backend's in-place load into tensors shaped like vLLM's parameters, per tp rank.

For each tp, rank 0's part of a random bf16 version (the ``vllm-fused`` layout, as
``WeightsClient.rank_tensors`` returns it: pageable host tensors) is copied into parameters
shaped as vLLM holds them on ``--device`` (vocabulary rows padded) by
:class:`~weightcast.client.vllm.inplace.InPlaceCopier` (pinned staging ring, non-blocking
copies), against the baseline measured in the same run: one blocking ``copy_`` per tensor
from pageable memory, as the backend did before. Each round loads another version, then
checks every parameter byte for byte, its padding rows zero and its ``data_ptr`` unchanged;
on CUDA a graph captured before the first load (a matmul with layer 0's qkv_proj) is replayed
after the last and must compute with the new weights. Medians over ``--rounds``, the first
round of each (allocation of the staging ring) left out.

    python -m bench inplace --shape 0.6B --tp 1 2 --device cuda
    .venv/bin/python -m bench inplace --shape tiny --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench_publisher import random_state
from common import save_json
from weightcast.client.vllm.inplace import InPlaceCopier
from weightcast.contract.fusion import assemble, plan_vllm_fused
from weightcast.contract.model_shape import SHAPES
from weightcast.contract.sharding import ShardKind, rank_slice

VOCAB_PADDING = 64
"""vLLM pads each rank's vocabulary rows to a multiple of this."""

GRAPHED = "model.layers.0.self_attn.qkv_proj.weight"


def two_versions(shape_name: str) -> list[dict[str, torch.Tensor]]:
    """Two random bf16 versions of the shape under HF names; the second flips every value's
    low bits (drawn once: 0.6B takes seconds)."""
    state = random_state(SHAPES[shape_name])
    flipped = {n: (t.view(torch.int16) ^ 0x0101).view(torch.bfloat16) for n, t in state.items()}
    return [state, flipped]


def rank_parts(shape_name: str, state: dict[str, torch.Tensor], tp: int) -> dict:
    """Rank 0's fused parts of ``state`` at ``tp`` (contiguous host tensors, as the reader
    returns them) with each one's shard kind."""
    shape = SHAPES[shape_name]
    parts = {}
    for spec in plan_vllm_fused({n: t.shape[0] for n, t in state.items()}, shape, tp):
        whole = assemble(spec, state)
        piece = rank_slice(spec.shard, list(whole.shape), 0, tp)
        if piece is not None:
            whole = whole.narrow(piece.dim, piece.start, piece.stop - piece.start)
        parts[spec.name] = (whole.contiguous(), spec.shard.kind)
    return parts


def engine_params(parts: dict, device: str) -> dict[str, torch.Tensor]:
    """Parameters shaped as vLLM holds rank 0's: the vocabulary padded to a multiple of 64."""
    params = {}
    for name, (part, kind) in parts.items():
        rows = part.shape[0]
        if kind == ShardKind.VOCAB_PARALLEL:
            rows = -(-rows // VOCAB_PADDING) * VOCAB_PADDING + VOCAB_PADDING
        params[name] = torch.full((rows, *part.shape[1:]), 1.0, dtype=part.dtype, device=device)
    return params


def blocking_copy(params: dict[str, torch.Tensor], parts: dict) -> None:
    """The baseline: one blocking copy per tensor from pageable memory."""
    for name, (part, _) in parts.items():
        params[name][: len(part)].copy_(part)
        params[name][len(part) :].zero_()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check(params: dict[str, torch.Tensor], parts: dict, pointers: dict[str, int]) -> None:
    for name, (part, _) in parts.items():
        param = params[name]
        if param.data_ptr() != pointers[name]:
            raise SystemExit(f"{name}: the parameter moved (data_ptr changed)")
        if not torch.equal(param[: len(part)].cpu(), part):
            raise SystemExit(f"{name}: the parameter differs from its part")
        if param[len(part) :].any():
            raise SystemExit(f"{name}: padding rows are not zero")


def bench_tp(args: argparse.Namespace, states: list[dict[str, torch.Tensor]], tp: int) -> dict:
    versions = [rank_parts(args.shape, state, tp) for state in states]
    params = engine_params(versions[0], args.device)
    pointers = {name: p.data_ptr() for name, p in params.items()}
    nbytes = sum(t.numel() * t.element_size() for t, _ in versions[0].values())
    graph = None
    if args.device.startswith("cuda"):
        x = torch.randn(4, params[GRAPHED].shape[1], dtype=torch.bfloat16, device=args.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = x @ params[GRAPHED].T  # warm-up off the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = x @ params[GRAPHED].T
    copier = InPlaceCopier()
    seconds: dict[str, list[float]] = {"inplace": [], "blocking": []}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for name, copy in (
            ("blocking", blocking_copy),
            ("inplace", lambda p, v: copier.copy(p, ((n, t) for n, (t, _) in v.items()))),
        ):
            parts = versions[(round_ + (name == "inplace")) % 2]
            synchronize(args.device)
            begin = time.perf_counter()
            copy(params, parts)
            synchronize(args.device)
            if round_:
                seconds[name].append(time.perf_counter() - begin)
            check(params, parts, pointers)
    last = versions[(args.rounds + 1) % 2]  # what the last in-place round loaded
    replayed = graph is not None
    if graph is not None:
        graph.replay()
        synchronize(args.device)
        if not torch.equal(out, x @ last[GRAPHED][0].to(args.device).T):
            raise SystemExit("the CUDA graph captured before the update computed with old weights")
    inplace, blocking = (statistics.median(seconds[k]) for k in ("inplace", "blocking"))
    return {
        "tp": tp,
        "bytes": nbytes,
        "inplace_s": inplace,
        "blocking_s": blocking,
        "inplace_gb_s": nbytes / inplace / 1e9,
        "blocking_gb_s": nbytes / blocking / 1e9,
        "speedup": blocking / inplace,
        "graph_replayed": replayed,
        "staging_allocations": copier.staging_allocations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.6B", choices=SHAPES)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    results = []
    print(f"in-place load of rank 0's part, {args.shape}, device {args.device}")
    print("tp  GB      in place (s)  GB/s    blocking (s)  GB/s    speedup  graph")
    states = two_versions(args.shape)
    for tp in args.tp:
        row = bench_tp(args, states, tp)
        results.append(row)
        print(
            f"{tp:<3} {row['bytes'] / 1e9:6.3f}  {row['inplace_s']:12.4f}  "
            f"{row['inplace_gb_s']:6.2f}  {row['blocking_s']:12.4f}  {row['blocking_gb_s']:6.2f}  "
            f"{row['speedup']:6.2f}x  {'replayed' if row['graph_replayed'] else '-'}"
        )
    report = {"shape": args.shape, "device": args.device, "rounds": args.rounds}
    save_json(args.json, report | {"results": results})


if __name__ == "__main__":
    main()
