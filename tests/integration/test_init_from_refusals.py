"""Every bad ``--init-from`` is one line naming the file, exit 2, and nothing written to the
checkpoint or resume directories (the real CLI, in process, on real ``save_pretrained``
checkpoints damaged as a disk or a user would)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcast.cli.main import main

from helpers.models import save_pretrained_qwen3


def truncate(start: Path) -> str:
    shard = sorted(start.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    return shard.name


def corrupt_header(start: Path) -> str:
    shard = sorted(start.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    return shard.name


def drop_shard(start: Path) -> str:
    shard = sorted(start.glob("model-*.safetensors"))[-1]
    shard.unlink()
    return "model.safetensors.index.json"


def rewrite(start: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    shard = sorted(start.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard.name


def wrong_shape(start: Path) -> str:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        name = next(iter(tensors))
        tensors[name] = torch.zeros(3, 5, dtype=tensors[name].dtype)

    return rewrite(start, change)


def wrong_dtype(start: Path) -> str:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        name = next(iter(tensors))
        tensors[name] = tensors[name].to(torch.int32)

    return rewrite(start, change)


def edit_config(start: Path, **over: object) -> str:
    path = start / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **over}))
    return "config.json"


CASES: dict[str, Callable[[Path], str]] = {
    "no-config": lambda start: (start / "config.json").unlink() or "config.json",
    "no-weights": lambda start: [p.unlink() for p in start.glob("model*")] and str(start),
    "truncated-shard": truncate,
    "corrupt-header": corrupt_header,
    "index-names-a-missing-shard": drop_shard,
    "wrong-shape": wrong_shape,
    "wrong-dtype": wrong_dtype,
    "moe-architecture-on-dense-weights": lambda start: edit_config(
        start, architectures=["Qwen3MoeForCausalLM"]
    ),
    "config-not-json": lambda start: (start / "config.json").write_text("{") and "config.json",
}


def run_trainer(tmp_path: Path, *args: str) -> int:
    return main(["trainer", "--checkpoint-dir", str(tmp_path / "checkpoints"), *args])


def assert_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], code: int, *names: str
) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("weightcast trainer: configuration error: "), err
    for name in names:
        assert name in lines[0], err
    for written in ("checkpoints", "checkpoints-resume"):
        assert not (tmp_path / written).exists(), written


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_qwen3(tmp_path_factory.mktemp("hf") / "start", shard_kb=60)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_start_is_one_line_naming_the_file_and_writes_nothing(
    case: str, sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = shutil.copytree(sharded, tmp_path / "start")
    named = CASES[case](start)
    code = run_trainer(tmp_path, "--init-from", str(start))
    assert_refused(tmp_path, capsys, code, Path(named).name)


def test_a_missing_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_trainer(tmp_path, "--init-from", str(tmp_path / "nowhere"))
    assert_refused(tmp_path, capsys, code, "nowhere", "no such directory")


def test_a_model_that_contradicts_config_json_names_both(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_trainer(tmp_path, "--init-from", str(sharded), "--model", "tiny")
    assert_refused(tmp_path, capsys, code, "trainer.model 'tiny'", str(sharded / "config.json"))


def test_a_torchtitan_initial_load_is_refused_naming_init_from(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "t.toml"
    config.write_text(
        f'[trainer.checkpoint]\ninitial_load_path = "{sharded}"\ninitial_load_in_hf = true\n'
    )
    code = run_trainer(tmp_path, "--config", str(config))
    assert_refused(tmp_path, capsys, code, "initial_load_path", "trainer.init_from")


EXPERT = "model.layers.2.mlp.experts.4.down_proj.weight"


def rewrite_expert(start: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Change the shard that holds :data:`EXPERT`, as ``change`` says; that shard's name."""
    index = json.loads((start / "model.safetensors.index.json").read_text())
    shard = start / index["weight_map"][EXPERT]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard.name


MOE_CASES: dict[str, tuple[Callable[[Path], object], tuple[str, ...]]] = {
    "expert-missing": (
        lambda start: rewrite_expert(start, lambda t: t.pop(EXPERT)),
        (EXPERT, "is missing"),
    ),
    "expert-wrong-shape": (
        lambda start: rewrite_expert(start, lambda t: t.update({EXPERT: t[EXPERT].T.contiguous()})),
        (EXPERT, "has shape [40, 48]; config.json implies [48, 40]"),
    ),
    "expert-wrong-dtype": (
        lambda start: rewrite_expert(start, lambda t: t.update({EXPERT: t[EXPERT].int()})),
        (EXPERT, "is I32"),
    ),
    "dense-layer-out-of-range": (
        lambda start: edit_config(start, mlp_only_layers=[1, 3]),
        ("config.json", "mlp_only_layers names layer 3; the model's layers are 0 to 2"),
    ),
    "sparse-layer-made-dense": (  # layers 0 and 2 would be dense: no dense MLP there
        lambda start: edit_config(start, decoder_sparse_step=2),
        ("model.layers.0.mlp.gate_proj.weight", "is missing"),
    ),
    "router-aux-loss": (
        lambda start: edit_config(start, output_router_logits=True),
        ("config.json", "output_router_logits is true"),
    ),
    "more-experts-per-token-than-experts": (
        lambda start: edit_config(start, num_experts_per_tok=7),
        ("config.json", "num_experts_per_tok 7 is more than num_experts 6"),
    ),
}


@pytest.fixture(scope="module")
def moe_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    start = tmp_path_factory.mktemp("hf") / "start"
    return save_pretrained_qwen3(start, "moe-untied-odd", shard_kb=60)


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_a_bad_moe_start_is_one_line_naming_what_is_wrong(
    case: str, moe_sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = shutil.copytree(moe_sharded, tmp_path / "start")
    damage, names = MOE_CASES[case]
    damage(start)
    code = run_trainer(tmp_path, "--init-from", str(start))
    assert_refused(tmp_path, capsys, code, *names)


@pytest.mark.parametrize(
    ("model", "differ"),
    [("tiny-moe", "num_experts=8"), ("tiny", "moe_enabled=False")],
)
def test_a_model_that_contradicts_an_moe_config_json_names_both(
    model: str, differ: str, moe_sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_trainer(tmp_path, "--init-from", str(moe_sharded), "--model", model)
    assert_refused(tmp_path, capsys, code, f"trainer.model {model!r}", differ)
