"""The fused layout of a Qwen3-MoE against an independent model of vLLM's ``FusedMoE`` loader
(``vllm_reference.fused_moe_rank``), for tensor and expert parallelism."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightcast.client.vllm.placement import hf_tensors, packed_name
from weightcast.client.vllm.staging import RankPart
from weightcast.contract.errors import LayoutError
from weightcast.contract.experts import FUSED_MOE, check_placement, local_experts
from weightcast.contract.fusion import unfuse
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.model_shape import ModelShape, check_shapes, expected_shape
from weightcast.contract.sharding import Shard, ShardKind, rank_slice
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast_publisher.converter import ConvertOptions, convert, rank_rows
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot

from helpers.models import hf_state, moe_shape
from helpers.snapshots import write_snapshot
from vllm_reference import fused_moe_rank

PLACEMENTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]


def expected_rank(
    state: dict[str, torch.Tensor], shape: ModelShape, layer: int, tp: int, rank: int, ep: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    p = f"model.layers.{layer}.mlp.experts"
    tensors = [
        [state[f"{p}.{e}.{x}_proj.weight"] for e in range(shape.num_experts)]
        for x in ("gate", "up", "down")
    ]
    return fused_moe_rank(*tensors, tp, rank, ep)


def publish(tmp_path: Path, shape: ModelShape, tp: int, ep: bool, **options: bool) -> Path:
    state = hf_state(shape, torch.bfloat16)
    snapshot_dir = write_snapshot(tmp_path, 5, shape, state)
    snapshot = Snapshot(snapshot_dir, SnapshotInfo.read(snapshot_dir))
    opts = ConvertOptions(tp=tp, expert_parallel=ep, **options)
    return convert(snapshot, tmp_path / "weights", 1, opts).path


@pytest.mark.parametrize(("tp", "ep"), PLACEMENTS)
def test_each_rank_block_is_what_fused_moe_loads_on_that_rank(
    tmp_path: Path, tp: int, ep: bool
) -> None:
    """Through a real DCP snapshot and the publisher: every rank's contiguous block of
    ``w13_weight`` / ``w2_weight`` is that rank's parameter; the router is replicated; the
    dense layer keeps ``gate_up_proj``; the manifest names the placement."""
    shape = moe_shape()
    state = hf_state(shape, torch.bfloat16)
    path = publish(tmp_path, shape, tp, ep)
    manifest = Manifest.read(path)
    verify_files(path, manifest)
    assert (manifest.tp, manifest.ep) == (tp, tp if ep else 1)
    fused = load_file(str(path / FUSED_WEIGHTS_FILE))
    entries = {t.name: t for t in manifest.tensors}
    assert set(entries) == set(fused)
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.{FUSED_MOE}"
        for rank in range(tp):
            w13, w2 = expected_rank(state, shape, layer, tp, rank, ep)
            for name, want in ((f"{prefix}.w13_weight", w13), (f"{prefix}.w2_weight", w2)):
                entry = entries[name]
                assert entry.shard.kind == ShardKind.EXPERTS
                part = rank_slice(entry.shard, entry.shape, rank, tp)
                assert part is not None and part.dim == 0
                assert torch.equal(fused[name][part.start : part.stop], want), (name, rank)
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert entries[router].shard == Shard(ShardKind.REPLICATED)
        assert torch.equal(fused[router], state[router])
    assert "model.layers.1.mlp.gate_up_proj.weight" in fused
    assert not any(".experts." in n for n in fused if n.startswith("model.layers.1."))


@pytest.mark.parametrize(("tp", "ep"), [(2, False), (4, True)])
def test_per_rank_files_hold_exactly_the_ranks_experts(tmp_path: Path, tp: int, ep: bool) -> None:
    shape = moe_shape()
    state = hf_state(shape, torch.bfloat16)
    path = publish(tmp_path, shape, tp, ep, per_rank_files=True)
    manifest = Manifest.read(path)
    verify_files(path, manifest)
    for rank in range(tp):
        part = load_file(str(path / fused_rank_file(rank, tp)))
        w13, w2 = expected_rank(state, shape, 0, tp, rank, ep)
        assert torch.equal(part[f"model.layers.0.{FUSED_MOE}.w13_weight"], w13)
        assert torch.equal(part[f"model.layers.0.{FUSED_MOE}.w2_weight"], w2)


@pytest.mark.parametrize(("tp", "ep"), [(2, False), (4, True)])
def test_every_rank_reads_one_contiguous_byte_range_of_each_expert_tensor(
    tp: int, ep: bool
) -> None:
    """The writer cuts blocks where a rank's bytes end (``rank_rows``): contiguous ranges that
    tile the tensor, rank after rank."""
    from weightcast.contract.plan import plan_version

    shape = moe_shape()
    sources = {n: ("BF16", tuple(t.shape)) for n, t in hf_state(shape).items()}
    plan = plan_version(sources, shape, tp, ep=tp if ep else 1)
    for tensor in plan.fused[0].tensors:
        if tensor.shard.kind != ShardKind.EXPERTS:
            continue
        ranges = rank_rows(tensor, tp)
        assert len(ranges) == tp and ranges[0][0] == 0 and ranges[-1][1] == tensor.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize(
    ("experts", "tp", "ep", "message"),
    [
        (6, 4, 4, "expert parallel over 4 ranks does not divide the 6 experts evenly"),
        (4, 8, 1, "tp=8 exceeds the 4 experts; vLLM refuses it"),
        (4, 2, 4, "ep=4 with tp=2: expert parallelism spans every rank (ep 2)"),
    ],
)
def test_placements_vllm_or_weightcast_refuse_are_one_line(
    experts: int, tp: int, ep: int, message: str
) -> None:
    with pytest.raises(LayoutError) as error:
        check_placement(moe_shape(experts=experts), tp, ep)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_tp_that_does_not_divide_the_expert_width_is_refused_unless_experts_are_whole() -> None:
    shape = moe_shape(experts=8, moe_inter=12)
    with pytest.raises(LayoutError, match="does not divide moe_intermediate_size 12"):
        check_placement(shape, 8, 1)
    check_placement(shape, 8, 8)


def test_the_publisher_refuses_experts_not_divisible_by_ranks(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="does not divide the 6 experts evenly"):
        publish(tmp_path, moe_shape(experts=6), 4, True)
    assert not (tmp_path / "weights" / "v1").exists()


def test_linear_expert_placement() -> None:
    shape = moe_shape(experts=8)
    assert [list(local_experts(shape, 4, r)) for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert list(local_experts(shape, 1, 0)) == list(range(8))


def test_config_json_of_a_moe_is_read_strictly() -> None:
    shape = moe_shape()
    config = shape.to_hf_config()
    assert ModelShape.from_hf_config(config) == shape
    # transformers 5 writes num_local_experts; Qwen's own configs num_experts.
    renamed = {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert ModelShape.from_hf_config(renamed) == shape
    for change, message in [
        ({"num_local_experts": 8}, "num_local_experts 8 and num_experts 4 differ"),
        ({"num_experts": 0}, "num_experts is 0, not a positive integer"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than num_experts 4"),
        ({"moe_intermediate_size": "16"}, "moe_intermediate_size is '16'"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size is None"),
        ({"mlp_only_layers": [3]}, "mlp_only_layers names layer 3; the model's layers are 0 to 2"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers is '1', not a list of layer indices"),
        ({"norm_topk_prob": 1}, "norm_topk_prob is 1, not true or false"),
        ({"decoder_sparse_step": -1}, "decoder_sparse_step is -1"),
    ]:
        with pytest.raises(LayoutError, match=re.escape(message)):
            ModelShape.from_hf_config(config | change)
    # Fields left out take Qwen3MoeConfig's defaults, as transformers and vLLM read them.
    bare = {k: v for k, v in config.items() if k not in ("num_experts", "moe_intermediate_size")}
    assert (
        ModelShape.from_hf_config(bare).num_experts,
        ModelShape.from_hf_config(bare).moe_intermediate_size,
    ) == (128, 768)
    dense = {k: v for k, v in config.items() if k not in ("model_type", "num_experts")}
    assert not ModelShape.from_hf_config(dense).moe


def test_decoder_sparse_step_and_mlp_only_layers_pick_the_sparse_layers() -> None:
    shape = dataclasses.replace(moe_shape(layers=6, dense_layers=(3,)), decoder_sparse_step=2)
    assert [shape.sparse(i) for i in range(6)] == [False, True, False, False, False, True]


def test_expert_and_router_shapes_come_from_the_config() -> None:
    shape = moe_shape()
    assert expected_shape("model.layers.0.mlp.gate.weight", shape) == (4, 16)
    assert expected_shape("model.layers.0.mlp.experts.3.gate_proj.weight", shape) == (16, 16)
    assert expected_shape("model.layers.0.mlp.experts.3.down_proj.weight", shape) == (16, 16)
    assert expected_shape("model.layers.1.mlp.gate_proj.weight", shape) == (32, 16)
    for name, message in [
        ("model.layers.0.mlp.experts.4.up_proj.weight", "only 4 experts"),
        ("model.layers.1.mlp.experts.0.up_proj.weight", "layer 1 is dense"),
        ("model.layers.0.mlp.gate_proj.weight", "layer 0 has experts, not a dense MLP"),
    ]:
        with pytest.raises(LayoutError, match=message):
            expected_shape(name, shape)
    state = hf_state(shape)
    state["model.layers.2.mlp.experts.1.down_proj.weight"] = torch.zeros(16, 8)
    with pytest.raises(LayoutError, match=r"experts.1.down_proj.weight has shape \[16, 8\]"):
        check_shapes({n: t.shape for n, t in state.items()}, shape)


def test_a_missing_expert_is_a_corrupt_snapshot(tmp_path: Path) -> None:
    shape = moe_shape()
    state = hf_state(shape, torch.bfloat16)
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    snapshot_dir = write_snapshot(tmp_path, 5, shape, state)
    snapshot = Snapshot(snapshot_dir, SnapshotInfo.read(snapshot_dir))
    with pytest.raises(CorruptSnapshot, match=r"experts\.3\.up_proj\.weight is missing"):
        convert(snapshot, tmp_path / "weights", 1, ConvertOptions(tp=2))


def test_fused_moe_config_names_the_marker_architecture(tmp_path: Path) -> None:
    """Stock vLLM refuses a fused MoE version as it does a dense one (tests/vllm runs it)."""
    path = publish(tmp_path, moe_shape(), 2, True)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["WeightcastFusedQwen3ForCausalLM"]
    assert config["model_type"] == "qwen3_moe"


@pytest.mark.parametrize(("tp", "ep"), [(1, False), (4, False), (2, True), (4, True)])
def test_loaders_fed_a_ranks_placed_experts_hold_its_block(
    tmp_path: Path, tp: int, ep: bool
) -> None:
    """``placement.hf_tensors`` turns a rank's block back into HF expert tensors placed where
    ``FusedMoE.weight_loader`` narrows (``vllm_reference.fused_moe_rank``): the loader then
    holds exactly the block; experts of other ranks are not handed over at all."""
    shape = moe_shape()
    path = publish(tmp_path, shape, tp, ep)
    fused = load_file(str(path / FUSED_WEIGHTS_FILE))
    entries = {t.name: t for t in Manifest.read(path).tensors}
    for rank in range(tp):
        parts = []
        for which in ("w13_weight", "w2_weight"):
            name = f"model.layers.2.{FUSED_MOE}.{which}"
            part = rank_slice(entries[name].shard, entries[name].shape, rank, tp)
            assert part is not None
            block = fused[name][part.start : part.stop]
            parts.append(RankPart(name, block, entries[name].shard))
        placed = dict(hf_tensors(parts, shape, rank, tp))
        mine = list(local_experts(shape, tp if ep else 1, rank))
        assert {int(n.split(".")[5]) for n in placed} == set(mine)
        blank = torch.zeros(1, 1)
        tensors = [
            [placed.get(f"model.layers.2.mlp.experts.{e}.{x}_proj.weight", blank) for e in range(4)]
            for x in ("gate", "up", "down")
        ]
        w13, w2 = fused_moe_rank(*tensors, tp, rank, ep)
        assert torch.equal(w13, parts[0].tensor) and torch.equal(w2, parts[1].tensor), rank
        assert {packed_name(n) for n in placed} == {p.name for p in parts}


@pytest.mark.parametrize(("tp", "ep"), PLACEMENTS)
def test_unfuse_gives_back_every_experts_hf_tensors(tmp_path: Path, tp: int, ep: bool) -> None:
    """What the publisher wrote for a placement, unfused, is the HF state dict it came from:
    each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``, the router, the dense layer."""
    shape = moe_shape()
    state = hf_state(shape, torch.bfloat16)
    fused = load_file(str(publish(tmp_path, shape, tp, ep) / FUSED_WEIGHTS_FILE))
    back = unfuse(fused, shape, tp)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_unfuse_refuses_expert_tensors_that_fit_no_placement(tmp_path: Path) -> None:
    shape = moe_shape()
    fused = load_file(str(publish(tmp_path, shape, 2, False) / FUSED_WEIGHTS_FILE))
    name = f"model.layers.2.{FUSED_MOE}.w2_weight"
    fused[name] = fused[name][:, :, :-1]
    with pytest.raises(LayoutError, match=r"w2_weight has shape \(8, 16, 7\); tp=2, ep=1 implies"):
        unfuse(fused, shape, 2)
    for name in [n for n in fused if n.endswith(("w13_weight", "w2_weight"))]:
        fused[name] = fused[name][:-1]
    with pytest.raises(LayoutError, match=r"^a FusedMoE parameter with 7 experts' rows fits no"):
        unfuse(fused, shape, 2)
