"""The streaming converter against real DCP snapshots of both formats: byte-exact with
``save_file`` and with the ``dcp.load`` path, FSDP-written snapshots, per-rank files, the HF
layout (linked when the snapshot already is one), Qwen3 sizes, damaged headers, NaN."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcast.contract.errors import LayoutError
from weightcast.contract.fusion import assemble, plan_vllm_fused
from weightcast.contract.layout import (
    FUSED_ARCHITECTURE,
    FUSED_WEIGHTS_FILE,
    LAYOUT_BOTH,
    fused_rank_file,
)
from weightcast.contract.manifest import Manifest, ManifestError, verify_files
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    INFO_NAME,
    SnapshotFile,
    SnapshotInfo,
    data_file_name,
    read_complete,
)
from weightcast.contract.tensorfile import read_header
from weightcast.runtime.durable import write_json
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot
from weightcast_publisher.sources import HeaderSource
from weightcast_trainer.dcp_safetensors import write_file

from helpers.models import hf_state, rank_part, shape_of
from helpers.snapshots import FORMATS, write_sharded_snapshot, write_snapshot
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)

SMALL = shape_of(4, 2, 16, hidden=32, inter=64, tied=False, bias=True)


def snapshot_at(path: Path) -> Snapshot:
    return Snapshot(path, read_complete(path))


def publish(tmp_path: Path, snapshot: Path, version: int, **options) -> Path:
    published = convert(
        snapshot_at(snapshot), tmp_path / "weights", version, ConvertOptions(**options)
    )
    verify_files(published.path, Manifest.read(published.path))
    return published.path


def reference_file(tmp_path: Path, state: dict, shape: ModelShape, tp: int) -> bytes:
    """What ``safetensors.torch.save_file`` writes for the fused tensors."""
    plan = plan_vllm_fused({k: t.shape[0] for k, t in state.items()}, shape, tp)
    path = tmp_path / f"reference-{tp}.safetensors"
    save_file({p.name: assemble(p, state).contiguous() for p in plan}, str(path), {"format": "pt"})
    return path.read_bytes()


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_byte_ranges_write_what_save_file_and_dcp_load_write(
    tmp_path: Path, tp: int, tied: bool, format: str
) -> None:
    shape = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    state = hf_state(shape, torch.bfloat16)
    state["model.norm.weight"] = state["model.norm.weight"].float()  # mixed dtypes, as save_file
    snapshot = write_snapshot(tmp_path, 1, shape, state, format)

    fast = convert(snapshot_at(snapshot), tmp_path / "w", 1, ConvertOptions(tp=tp))
    slow = convert(
        snapshot_at(snapshot), tmp_path / "w", 2, ConvertOptions(tp=tp, reader="dcp-load")
    )

    new = format == FORMAT_DCP_SAFETENSORS
    assert (fast.reader, slow.reader) == ("byte-range" if new else "dcp-load", "dcp-load")
    data = (fast.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == (slow.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == reference_file(tmp_path, state, shape, tp)
    assert fast.manifest.dtype == "mixed"


@pytest.mark.slow
@pytest.mark.parametrize("format", FORMATS)
def test_a_snapshot_written_by_two_fsdp_ranks_converts_to_the_same_bytes(
    tmp_path: Path, format: str
) -> None:
    shape = dataclasses.replace(SMALL, vocab_size=67)  # odd rows: uneven shards
    state = hf_state(shape, torch.bfloat16)
    single = write_snapshot(tmp_path / "one", 1, shape, state, format)
    sharded = write_sharded_snapshot(tmp_path / "two", 1, shape, state, 2, format)
    if format == FORMAT_DCP_SAFETENSORS:
        index = HeaderSource(snapshot_at(sharded)).index
        chunks = index["model.embed_tokens.weight"].chunks
        assert [(c.row_start, c.row_stop) for c in chunks] == [(0, 34), (34, 67)]
        assert {c.file.name for c in chunks} == {  # really split over two files
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        }
    else:
        assert {p.name for p in sharded.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}

    for tp in (1, 2):
        a = publish(tmp_path, single, 10 + tp, tp=tp)
        b = publish(tmp_path, sharded, 20 + tp, tp=tp)
        assert (a / FUSED_WEIGHTS_FILE).read_bytes() == (b / FUSED_WEIGHTS_FILE).read_bytes()
    assert (a / FUSED_WEIGHTS_FILE).read_bytes() == reference_file(tmp_path, state, shape, 2)
    # Per-rank files cut o_proj / down_proj by columns across both ranks' row blocks.
    a = publish(tmp_path, single, 31, tp=2, per_rank_files=True)
    b = publish(tmp_path, sharded, 32, tp=2, per_rank_files=True)
    for rank in range(2):
        name = fused_rank_file(rank, 2)
        assert (a / name).read_bytes() == (b / name).read_bytes()
    # Two rank files are not an HF file: the hf layout copies them into one.
    hf = publish(tmp_path, sharded, 41, layout="hf")
    assert load_file(str(hf / "model-00001-of-00001.safetensors")).keys() == state.keys()


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_files_hold_exactly_what_vllm_loads_on_each_rank(
    tmp_path: Path, tp: int, format: str
) -> None:
    state = hf_state(SMALL, torch.bfloat16)
    snapshot = write_snapshot(tmp_path, 1, SMALL, state, format)
    whole = load_file(str(publish(tmp_path, snapshot, 1, tp=tp) / FUSED_WEIGHTS_FILE))
    version = publish(tmp_path, snapshot, 2, tp=tp, per_rank_files=True)
    manifest = Manifest.read(version)

    assert manifest.per_rank_files
    assert not (version / FUSED_WEIGHTS_FILE).exists()  # per-rank versions write only ranks
    assert sorted(f.name for f in manifest.files) == sorted(
        ["config.json"] + [fused_rank_file(r, tp) for r in range(tp)]
    )
    assert len(manifest.tensors) == tp * len(whole)
    for rank in range(tp):
        mine = load_file(str(version / fused_rank_file(rank, tp)))
        entries = {e.name: e for e in manifest.tensors if e.rank == rank}
        assert entries.keys() == mine.keys() == whole.keys()
        for name, tensor in whole.items():
            entry = entries[name]
            assert entry.file == fused_rank_file(rank, tp)
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


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("tied", [True, False])
def test_hf_layout_loads_in_transformers_with_the_source_logits(
    tmp_path: Path, tied: bool, format: str
) -> None:
    """The ``hf`` layout, and ``both`` (the same HF files in ``hf/`` beside the fused ones)."""
    shape = shape_of(4, 2, 16, hidden=64, inter=128, tied=tied)
    state = hf_state(shape, torch.bfloat16)
    config = {**shape.to_hf_config(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    config |= {"rms_norm_eps": 1e-6, "max_position_embeddings": 128, "rope_theta": 10000.0}
    snapshot = write_snapshot(tmp_path, 1, shape, state, format)
    (snapshot / "config.json").write_text(json.dumps(config))
    hf_files = {}
    for number, layout in enumerate(["hf", LAYOUT_BOTH], start=1):
        published = convert(
            snapshot_at(snapshot), tmp_path / "weights", number, ConvertOptions(tp=2, layout=layout)
        )
        version = published.path
        manifest = Manifest.read(version)
        verify_files(version, manifest)
        hf_dir = version / "hf" if layout == LAYOUT_BOTH else version

        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(state)
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
        # A one-rank dcp-safetensors snapshot already is the HF file: linked, not copied.
        new = format == FORMAT_DCP_SAFETENSORS
        assert published.linked == int(new)
        shard = hf_dir / "model-00001-of-00001.safetensors"
        if new:
            source = snapshot / "shard-00001-model-00001-of-00001.safetensors"
            assert shard.stat().st_ino == source.stat().st_ino
        if layout == LAYOUT_BOTH:
            assert manifest.hf_dir == "hf" and (version / FUSED_WEIGHTS_FILE).is_file()
            assert "model.layers.0.self_attn.qkv_proj.weight" in {t.name for t in manifest.tensors}
            assert "hf/model.safetensors.index.json" in {f.name for f in manifest.files}
            # The fused files beside it carry the marker that stops stock vLLM loading them.
            top = json.loads((version / "config.json").read_text())
            assert top == {**config, "architectures": [FUSED_ARCHITECTURE]}
        else:
            assert manifest.layout == "hf" and not (version / FUSED_WEIGHTS_FILE).exists()
        assert json.loads((hf_dir / "config.json").read_text()) == config  # for stock readers
        hf_files[layout] = {
            p.name: p.read_bytes() for p in hf_dir.iterdir() if p.name != "manifest.json"
        }
    assert hf_files[LAYOUT_BOTH] == hf_files["hf"]  # one HF model, in either layout
    hf_only = tmp_path / "weights" / "v1"
    expected = transformers_logits(None, state, config)
    actual = transformers_logits(hf_only, state, config)
    assert torch.equal(actual, expected)
    assert expected.std() > 0.1


# Real Qwen3 head counts (head_dim 128 scaled down), tied embeddings as the real configs.
QWEN3 = {
    "0.6B and 1.7B": dict(heads=16, kv=8, tied=True),  # the same heads: one case
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
    """Real head counts, head_dim scaled down; whole fused files and per-rank files. From
    the trainer's snapshot format: that the other format's reader gives the same bytes is
    checked above (byte ranges, per-rank files)."""
    spec = QWEN3[model]
    shape = shape_of(
        spec["heads"], spec["kv"], 8, hidden=32, inter=64, tied=spec["tied"], bias=bias
    )
    state = hf_state(shape, torch.bfloat16)
    snapshot = write_snapshot(tmp_path, 1, shape, state)
    kinds = ["weight", "bias"] if bias else ["weight"]
    for tp in (1, 2, 4, 8, 16):
        version = publish(tmp_path, snapshot, tp, tp=tp)
        fused = load_file(str(version / FUSED_WEIGHTS_FILE))
        assert ("lm_head.weight" in fused) != spec["tied"]
        assert "model.layers.1.self_attn.q_norm.weight" in fused
        per_rank = publish(tmp_path, snapshot, 100 + tp, tp=tp, per_rank_files=True)
        for rank in range(tp):
            mine = load_file(str(per_rank / fused_rank_file(rank, tp))) if tp > 1 else fused
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
        convert(snapshot_at(snapshot), tmp_path / "w", 99, ConvertOptions(tp=3))
    assert not (tmp_path / "w" / ".tmp-v99").exists()


def test_a_tp_vllm_refuses_is_refused_with_the_reason() -> None:
    with pytest.raises(LayoutError, match="does not divide the 16 attention heads"):
        plan_vllm_fused({}, shape_of(16, 8, 4), 32)
    with pytest.raises(LayoutError, match="does not divide intermediate_size 48"):
        plan_vllm_fused({}, shape_of(32, 8, 4, inter=48), 32)


def write_blocks(
    checkpoint_dir: Path, shape: ModelShape, state: dict, embed_blocks: list[tuple[int, int]]
) -> Path:
    """A dcp-safetensors snapshot whose embedding is stored as the given row blocks, one file
    each (the first file also holds every other tensor), as ranks would write it."""
    path = checkpoint_dir / "step-1"
    path.mkdir(parents=True)
    embed = "model.embed_tokens.weight"
    files = []
    for i, (start, stop) in enumerate(embed_blocks):
        tensors = {embed: state[embed][start:stop].contiguous()}
        if i == 0:
            tensors |= {k: v for k, v in state.items() if k != embed}
        offsets = {
            k: {"saved_offsets": [start if k == embed else 0] + [0] * (v.dim() - 1)}
            for k, v in tensors.items()
        }
        name = data_file_name(i)
        files.append(SnapshotFile(name, write_file(path / name, tensors, offsets)))
    (path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    info = SnapshotInfo("id", "run", 1, 0.0, "bfloat16", "t", FORMAT_DCP_SAFETENSORS, tuple(files))
    write_json(path / INFO_NAME, info.to_json())
    return path


@pytest.mark.parametrize(
    ("blocks", "reason"),
    [
        ([(0, 30), (32, 64)], "model.embed_tokens.weight: its blocks leave a gap at row 30"),
        ([(0, 34), (30, 64)], "model.embed_tokens.weight: its blocks overlap at row 30"),
        ([(0, 32)], "model.embed_tokens.weight has shape [32, 32]; the config implies [64, 32]"),
    ],
)
def test_blocks_that_do_not_tile_a_tensor_are_a_corrupt_snapshot(
    tmp_path: Path, blocks: list, reason: str
) -> None:
    state = hf_state(SMALL, torch.bfloat16)
    snapshot = write_blocks(tmp_path / "checkpoints", SMALL, state, blocks)
    with pytest.raises(CorruptSnapshot, match=re.escape(reason)):
        convert(snapshot_at(snapshot), tmp_path / "w", 1, ConvertOptions(tp=2))
    assert not (tmp_path / "w").exists() or not list((tmp_path / "w").iterdir())
    # The same blocks, whole and in order, publish the state itself.
    good = write_blocks(tmp_path / "good", SMALL, state, [(0, 40), (40, 64)])
    published = publish(tmp_path, good, 2, tp=2)
    assert (published / FUSED_WEIGHTS_FILE).read_bytes() == reference_file(
        tmp_path, state, SMALL, 2
    )


def test_blocks_that_are_not_whole_rows_are_read_with_dcp_load(tmp_path: Path) -> None:
    """Column blocks (a tensor-parallel trainer's) are valid: dcp.load assembles them."""
    state = hf_state(SMALL, torch.bfloat16)
    path = tmp_path / "step-1"
    path.mkdir()
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    half = state[o_proj].shape[1] // 2
    first = {k: v for k, v in state.items() if k != o_proj} | {o_proj: state[o_proj][:, :half]}
    offsets = {k: {"saved_offsets": [0] * v.dim()} for k, v in first.items()}
    files = [SnapshotFile(data_file_name(0), write_file(path / data_file_name(0), first, offsets))]
    second = {o_proj: state[o_proj][:, half:].contiguous()}
    first[o_proj] = first[o_proj].contiguous()
    size = write_file(path / data_file_name(1), second, {o_proj: {"saved_offsets": [0, half]}})
    files.append(SnapshotFile(data_file_name(1), size))
    files[0] = SnapshotFile(data_file_name(0), write_file(path / data_file_name(0), first, offsets))
    (path / "config.json").write_text(json.dumps(SMALL.to_hf_config()))
    info = SnapshotInfo("id", "run", 1, 0.0, "bfloat16", "t", FORMAT_DCP_SAFETENSORS, tuple(files))
    write_json(path / INFO_NAME, info.to_json())

    published = convert(snapshot_at(path), tmp_path / "w", 1, ConvertOptions(tp=2))
    assert published.reader == "dcp-load"
    data = (published.path / FUSED_WEIGHTS_FILE).read_bytes()
    assert data == reference_file(tmp_path, state, SMALL, 2)


def poison(snapshot: Path, name: str, value: float) -> None:
    """Overwrite the first element of tensor ``name`` in the snapshot's files with ``value``
    (bits on disk: the trainer's writer would refuse to write it)."""
    info = SnapshotInfo.read(snapshot)
    if info.format == FORMAT_DCP_TORCH_SAVE:
        state = hf_state(SMALL, torch.bfloat16)
        state[name] = state[name].clone()
        state[name].view(-1)[0] = value
        shutil.rmtree(snapshot)
        write_snapshot(snapshot.parent, info.step, SMALL, state, FORMAT_DCP_TORCH_SAVE)
        return
    file = snapshot / info.files[0].name
    with open(file, "r+b") as f:
        span = next(s for s in read_header(f.fileno(), "data").tensors if s.name == name)
        element = torch.tensor([value], dtype=TORCH_DTYPES[span.dtype])
        f.seek(span.start)
        f.write(element.view(torch.uint8).numpy().tobytes())


TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize(
    ("layout", "per_rank"), [("vllm-fused", False), ("vllm-fused", True), ("hf", False)]
)
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model.layers.1.mlp.down_proj.weight", float("nan")),
        ("model.layers.0.self_attn.k_proj.bias", float("-inf")),
        ("model.embed_tokens.weight", float("inf")),
    ],
)
def test_a_non_finite_weight_is_a_corrupt_snapshot(
    tmp_path: Path, format: str, layout: str, per_rank: bool, name: str, value: float
) -> None:
    """Checked on the bytes as they are copied (or, for a linked file, digested)."""
    snapshot = write_snapshot(tmp_path / "checkpoints", 1, SMALL, None, format)
    poison(snapshot, name, value)
    options = ConvertOptions(tp=2, layout=layout, per_rank_files=per_rank)
    published = name if layout == "hf" else name.replace("k_proj", "qkv_proj")  # fused
    with pytest.raises(CorruptSnapshot, match=f"non-finite weights: {re.escape(published)} holds"):
        convert(snapshot_at(snapshot), tmp_path / "w", 1, options)
    assert not list((tmp_path / "w").iterdir())  # nothing partial left behind


def test_a_float32_infinity_is_found_too(tmp_path: Path) -> None:
    state = hf_state(SMALL, torch.bfloat16)
    state["model.norm.weight"] = state["model.norm.weight"].float()
    snapshot = write_snapshot(tmp_path / "checkpoints", 1, SMALL, state)
    poison(snapshot, "model.norm.weight", float("inf"))
    with pytest.raises(CorruptSnapshot, match=r"model\.norm\.weight holds NaN or infinite"):
        convert(snapshot_at(snapshot), tmp_path / "w", 1, ConvertOptions(tp=1))


@pytest.mark.parametrize("digest", ["xxh3-128", "blake3"])
def test_block_digests_of_every_file_in_the_chosen_algorithm(tmp_path: Path, digest: str) -> None:
    snapshot = write_snapshot(tmp_path, 1, SMALL)
    options = ConvertOptions(tp=2, layout=LAYOUT_BOTH, digest=digest)
    published = convert(snapshot_at(snapshot), tmp_path / "w", 1, options)
    manifest = Manifest.read(published.path)
    assert {f.blocks.algorithm for f in manifest.files} == {digest}
    verify_files(published.path, manifest)
    target = published.path / FUSED_WEIGHTS_FILE
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="do not match the manifest"):
        verify_files(published.path, manifest)
