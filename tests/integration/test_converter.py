"""The streaming converter against real DCP snapshots: byte-exact with ``save_file`` and with
the ``dcp.load`` path, FSDP-written snapshots, per-rank files, the HF layout, Qwen3 sizes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcast.contract.layout import (
    FUSED_ARCHITECTURE,
    FUSED_WEIGHTS_FILE,
    LayoutError,
    ModelShape,
    assemble,
    plan_vllm_fused,
)
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.snapshots import SnapshotInfo
from weightcast.publisher.converter import LAYOUT_BOTH, ConvertOptions, convert, rank_file_name
from weightcast.publisher.dcp_index import index_snapshot
from weightcast.publisher.snapshot_reader import Snapshot

from helpers import (
    hf_config,
    hf_state,
    rank_part,
    shape_of,
    write_sharded_snapshot,
    write_snapshot,
)
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)

SMALL = shape_of(4, 2, 16, hidden=32, inter=64, tied=False, bias=True)


def snapshot_at(path: Path) -> Snapshot:
    return Snapshot(path, SnapshotInfo.read(path))


def publish(tmp_path: Path, snapshot: Path, version: int, **options) -> Path:
    published = convert(snapshot_at(snapshot), tmp_path / "weights", version, **options)
    verify_files(published.path, Manifest.read(published.path))
    return published.path


def reference_file(tmp_path: Path, state: dict, shape: ModelShape, tp: int) -> bytes:
    """What ``safetensors.torch.save_file`` writes for the fused tensors."""
    plan = plan_vllm_fused({k: t.shape[0] for k, t in state.items()}, shape, tp)
    path = tmp_path / f"reference-{tp}.safetensors"
    save_file({p.name: assemble(p, state).contiguous() for p in plan}, str(path), {"format": "pt"})
    return path.read_bytes()


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_byte_ranges_write_what_save_file_and_dcp_load_write(
    tmp_path: Path, tp: int, tied: bool
) -> None:
    shape = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    state = hf_state(shape, torch.bfloat16)
    state["model.norm.weight"] = state["model.norm.weight"].float()  # mixed dtypes, as save_file
    snapshot = write_snapshot(tmp_path, 1, shape, state)

    fast = convert(snapshot_at(snapshot), tmp_path / "w", 1, options=ConvertOptions(tp=tp))
    slow = convert(
        snapshot_at(snapshot), tmp_path / "w", 2, options=ConvertOptions(tp=tp, reader="dcp-load")
    )

    assert (fast.reader, slow.reader) == ("byte-range", "dcp-load")
    data = (fast.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == (slow.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == reference_file(tmp_path, state, shape, tp)
    assert fast.manifest.dtype == "mixed"


@pytest.mark.slow
def test_a_snapshot_written_by_two_fsdp_ranks_converts_to_the_same_bytes(tmp_path: Path) -> None:
    shape = dataclasses.replace(SMALL, vocab_size=67)  # odd rows: uneven shards
    state = hf_state(shape, torch.bfloat16)
    single = write_snapshot(tmp_path / "one", 1, shape, state)
    sharded = write_sharded_snapshot(tmp_path / "two", 1, shape, state, ranks=2)
    index = index_snapshot(sharded)
    assert len(index["model.embed_tokens.weight"].chunks) == 2  # really split over two files
    assert {c.file.name for c in index["model.embed_tokens.weight"].chunks} == {
        "__0_0.distcp",
        "__1_0.distcp",
    }

    for tp in (1, 2):
        a = publish(tmp_path, single, 10 + tp, options=ConvertOptions(tp=tp))
        b = publish(tmp_path, sharded, 20 + tp, options=ConvertOptions(tp=tp))
        assert (a / FUSED_WEIGHTS_FILE).read_bytes() == (b / FUSED_WEIGHTS_FILE).read_bytes()
    assert (a / FUSED_WEIGHTS_FILE).read_bytes() == reference_file(tmp_path, state, shape, 2)
    # Per-rank files cut o_proj / down_proj by columns across both ranks' row blocks.
    options = ConvertOptions(tp=2, per_rank_files=True)
    a, b = (
        publish(tmp_path, single, 31, options=options),
        publish(tmp_path, sharded, 32, options=options),
    )
    for rank in range(2):
        name = rank_file_name(rank, 2)
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_storage_it_does_not_recognise_falls_back_to_dcp_load(tmp_path: Path) -> None:
    state = hf_state(SMALL, torch.bfloat16)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    transposed = state[o_proj].t().contiguous().t()  # same values, column-major storage
    snapshot = write_snapshot(tmp_path, 1, SMALL, {**state, o_proj: transposed})
    published = convert(snapshot_at(snapshot), tmp_path / "w", 1, options=ConvertOptions(tp=2))
    assert published.reader == "dcp-load"
    data = (published.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == reference_file(tmp_path, state, SMALL, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_files_hold_exactly_what_vllm_loads_on_each_rank(tmp_path: Path, tp: int) -> None:
    state = hf_state(SMALL, torch.bfloat16)
    snapshot = write_snapshot(tmp_path, 1, SMALL, state)
    whole = load_file(str(publish(tmp_path, snapshot, 1, tp=tp) / FUSED_WEIGHTS_FILE))
    version = publish(tmp_path, snapshot, 2, options=ConvertOptions(tp=tp, per_rank_files=True))
    manifest = Manifest.read(version)

    assert manifest.per_rank_files
    assert not (version / FUSED_WEIGHTS_FILE).exists()  # per-rank versions write only ranks
    assert sorted(f.name for f in manifest.files) == sorted(
        ["config.json"] + [rank_file_name(r, tp) for r in range(tp)]
    )
    assert len(manifest.tensors) == tp * len(whole)
    for rank in range(tp):
        mine = load_file(str(version / rank_file_name(rank, tp)))
        entries = {e.name: e for e in manifest.tensors if e.rank == rank}
        assert entries.keys() == mine.keys() == whole.keys()
        for name, tensor in whole.items():
            entry = entries[name]
            assert entry.file == rank_file_name(rank, tp)
            assert list(mine[name].shape) == entry.shape
            expected = rank_part(tensor, entry.shard, rank, tp)
            assert torch.equal(mine[name], expected), f"{name} rank {rank}"
        # Independently of rank_slice: what vLLM's loaders put on this rank.
        attn = "model.layers.1.self_attn"
        assert torch.equal(
            mine[f"{attn}.qkv_proj.weight"],
            qkv_parallel_rank(
                *(state[f"{attn}.{x}_proj.weight"] for x in "qkv"),
                SMALL.num_heads,
                SMALL.num_kv_heads,
                SMALL.head_dim,
                tp,
                rank,
            ),
        )
        assert torch.equal(
            mine[f"{attn}.o_proj.weight"],
            row_parallel_rank(state[f"{attn}.o_proj.weight"], tp, rank),
        )
        lm_head = vocab_parallel_rank(state["lm_head.weight"], tp, rank)
        assert torch.equal(mine["lm_head.weight"], lm_head[: mine["lm_head.weight"].shape[0]])


def transformers_logits(model_dir: Path | None, state: dict, config: dict) -> torch.Tensor:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if model_dir is None:
        model = Qwen3ForCausalLM(Qwen3Config.from_dict(config))
        model.load_state_dict(state, strict=not config["tie_word_embeddings"])
        if config["tie_word_embeddings"]:
            model.tie_weights()
    else:
        model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    tokens = torch.arange(24).reshape(2, 12) % config["vocab_size"]
    with torch.no_grad():
        return model.float().eval()(tokens).logits


@pytest.mark.parametrize("layout", ["hf", LAYOUT_BOTH])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_layout_loads_in_transformers_with_the_source_logits(
    tmp_path: Path, layout: str, tied: bool
) -> None:
    shape = shape_of(4, 2, 16, hidden=64, inter=128, tied=tied)
    state = hf_state(shape, torch.bfloat16)
    config = {**hf_config(shape), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    config |= {"rms_norm_eps": 1e-6, "max_position_embeddings": 128, "rope_theta": 10000.0}
    snapshot = write_snapshot(tmp_path, 1, shape, state)
    (snapshot / "config.json").write_text(json.dumps(config))
    version = publish(tmp_path, snapshot, 1, options=ConvertOptions(tp=2, layout=layout))
    manifest = Manifest.read(version)
    hf_dir = version / "hf" if layout == LAYOUT_BOTH else version

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    if layout == LAYOUT_BOTH:
        assert manifest.hf_dir == "hf" and (version / FUSED_WEIGHTS_FILE).is_file()
        assert "model.layers.0.self_attn.qkv_proj.weight" in {t.name for t in manifest.tensors}
        assert "hf/model.safetensors.index.json" in {f.name for f in manifest.files}
        # The fused files beside it carry the marker that stops stock vLLM from loading them.
        top = json.loads((version / "config.json").read_text())
        assert top == {**config, "architectures": [FUSED_ARCHITECTURE]}
    else:
        assert manifest.layout == "hf" and not (version / FUSED_WEIGHTS_FILE).exists()
    assert json.loads((hf_dir / "config.json").read_text()) == config  # what stock readers need
    expected = transformers_logits(None, state, config)
    actual = transformers_logits(hf_dir, state, config)
    assert torch.equal(actual, expected)
    assert expected.std() > 0.1


# Real Qwen3 head counts (head_dim 128 scaled down), tied embeddings as the real configs.
QWEN3 = {
    "0.6B": dict(heads=16, kv=8, tied=True),
    "1.7B": dict(heads=16, kv=8, tied=True),
    "4B": dict(heads=32, kv=8, tied=True),
    "8B": dict(heads=32, kv=8, tied=False),
}


def expected_gate_up(state: dict, layer: int, tp: int, rank: int) -> torch.Tensor:
    mlp = f"model.layers.{layer}.mlp"
    return merged_column_parallel_rank(
        state[f"{mlp}.gate_proj.weight"], state[f"{mlp}.up_proj.weight"], tp, rank
    )


def expected_qkv(state: dict, shape: ModelShape, layer: int, kind: str, tp: int, rank: int):
    attn = f"model.layers.{layer}.self_attn"
    return qkv_parallel_rank(
        *(state[f"{attn}.{x}_proj.{kind}"] for x in "qkv"),
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        tp,
        rank,
    )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("model", list(QWEN3))
def test_every_qwen3_size_and_tp_through_the_real_converter(
    tmp_path: Path, model: str, bias: bool
) -> None:
    """Real head counts, head_dim scaled down; whole fused files and per-rank files."""
    spec = QWEN3[model]
    shape = shape_of(
        spec["heads"], spec["kv"], 8, hidden=32, inter=64, tied=spec["tied"], bias=bias
    )
    state = hf_state(shape, torch.bfloat16)
    snapshot = write_snapshot(tmp_path, 1, shape, state)
    kinds = ["weight", "bias"] if bias else ["weight"]
    for tp in (1, 2, 4, 8, 16):
        version = publish(tmp_path, snapshot, tp, options=ConvertOptions(tp=tp))
        fused = load_file(str(version / FUSED_WEIGHTS_FILE))
        assert ("lm_head.weight" in fused) != spec["tied"]
        assert "model.layers.1.self_attn.q_norm.weight" in fused
        per_rank = publish(
            tmp_path, snapshot, 100 + tp, options=ConvertOptions(tp=tp, per_rank_files=True)
        )
        for rank in range(tp):
            mine = load_file(str(per_rank / rank_file_name(rank, tp))) if tp > 1 else fused
            for layer in range(shape.num_layers):
                attn = f"model.layers.{layer}.self_attn"
                for kind in kinds:
                    expected = expected_qkv(state, shape, layer, kind, tp, rank)
                    block = fused[f"{attn}.qkv_proj.{kind}"].chunk(tp)[rank]
                    assert torch.equal(block, expected), f"{model} tp={tp} rank {rank}"
                    assert torch.equal(mine[f"{attn}.qkv_proj.{kind}"], expected)
                expected = expected_gate_up(state, layer, tp, rank)
                block = fused[f"model.layers.{layer}.mlp.gate_up_proj.weight"].chunk(tp)[rank]
                assert torch.equal(block, expected)
                assert torch.equal(mine[f"model.layers.{layer}.mlp.gate_up_proj.weight"], expected)
    with pytest.raises(LayoutError, match="does not divide"):
        convert(snapshot_at(snapshot), tmp_path / "w", 99, options=ConvertOptions(tp=3))
    assert not (tmp_path / "w" / ".tmp-v99").exists()


def test_a_tp_vllm_refuses_is_refused_with_the_reason() -> None:
    with pytest.raises(LayoutError, match="does not divide the 16 attention heads"):
        plan_vllm_fused({}, shape_of(16, 8, 4), 32)
    with pytest.raises(LayoutError, match="does not divide intermediate_size 48"):
        plan_vllm_fused({}, shape_of(32, 8, 4, inter=48), 32)
