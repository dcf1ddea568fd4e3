"""Published weights reproduce the trained model's logits in an independent implementation.

A real trainer process trains the tiny model on batches from a real redis-server and writes a
snapshot; a real publisher converts it. The published tensors, un-fused and loaded into
transformers' ``Qwen3ForCausalLM`` built from the published ``config.json``, must give the
logits of torchtitan's Qwen3 holding the snapshot's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightcast.contract.fusion import unfuse
from weightcast.contract.layout import FUSED_WEIGHTS_FILE
from weightcast.contract.manifest import Manifest
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast_publisher.dcp_load import load_tensors
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast_trainer.model import TiedQwen3Model, flavor_args

from helpers.processes import run_weightcast


def torchtitan_logits(snapshot_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    args = flavor_args("tiny")
    model = TiedQwen3Model(args)
    hf = load_tensors(Snapshot(snapshot_dir, SnapshotInfo.read(snapshot_dir)))
    assert "lm_head.weight" not in hf  # tied: the snapshot holds it once
    state = Qwen3StateDictAdapter(args, None).from_hf(hf)
    model.init_weights()  # ties output to tok_embeddings, builds the RoPE cache
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["output.weight"] and unexpected == []
    model.float().eval()
    with torch.no_grad():
        return model(tokens)


def transformers_logits(version_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = json.loads((version_dir / "config.json").read_text())
    manifest = Manifest.read(version_dir)
    published = load_file(str(version_dir / FUSED_WEIGHTS_FILE))
    hf_state = unfuse(published, ModelShape.from_hf_config(config), manifest.tp)
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(config))
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to embed_tokens
    model.float().eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("tp", [1, 4])
def test_published_weights_give_the_torchtitan_logits(
    cli_env: dict[str, str], tmp_path: Path, tp: int
) -> None:
    produced = run_weightcast(cli_env, "produce", "--count", "3", "--seq-len", "32")
    assert produced.returncode == 0, produced.stderr
    trained = run_weightcast(cli_env, "trainer", "--steps", "3", "--publish-every", "3")
    assert trained.returncode == 0, trained.stderr
    published = run_weightcast(cli_env, "publisher", "--once", "--tp", str(tp))
    assert published.returncode == 0, published.stderr

    snapshot_dir = tmp_path / "checkpoints" / "step-3"
    version_dir = tmp_path / "weights" / "v1"
    tokens = torch.randint(
        0, flavor_args("tiny").vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)
    )
    expected = torchtitan_logits(snapshot_dir, tokens)
    actual = transformers_logits(version_dir, tokens)
    assert actual.shape == expected.shape == (2, 48, flavor_args("tiny").vocab_size)
    # Same bf16 weights, both computed in float32: only kernel rounding may differ.
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert expected.std() > 0.1  # real logits, not a degenerate model
