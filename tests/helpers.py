"""Test helpers: synthetic HF state dicts and snapshots, and the weightcast CLI as a process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shared.layout import ModelShape
from shared.snapshots import SnapshotInfo, snapshot_name

REPO = Path(__file__).resolve().parent.parent


def shape_of(
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int = 8,
    inter: int = 32,
    tied: bool = True,
    bias: bool = False,
) -> ModelShape:
    return ModelShape(
        num_layers=2,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=64,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )


def hf_state(shape: ModelShape, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A random HF-named Qwen3 state dict of this shape (unique values, so swaps show)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen).to(dtype)

    h, d = shape.hidden_size, shape.head_dim
    state = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": rand(h)}
    if not shape.tie_word_embeddings:
        state["lm_head.weight"] = rand(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        state |= {
            f"{p}.self_attn.q_proj.weight": rand(shape.q_rows, h),
            f"{p}.self_attn.k_proj.weight": rand(shape.kv_rows, h),
            f"{p}.self_attn.v_proj.weight": rand(shape.kv_rows, h),
            f"{p}.self_attn.o_proj.weight": rand(h, shape.q_rows),
            f"{p}.self_attn.q_norm.weight": rand(d),
            f"{p}.self_attn.k_norm.weight": rand(d),
            f"{p}.mlp.gate_proj.weight": rand(shape.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": rand(shape.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": rand(h, shape.intermediate_size),
            f"{p}.input_layernorm.weight": rand(h),
            f"{p}.post_attention_layernorm.weight": rand(h),
        }
        if shape.attention_bias:
            state |= {
                f"{p}.self_attn.{x}_proj.bias": rand(rows)
                for x, rows in (("q", shape.q_rows), ("k", shape.kv_rows), ("v", shape.kv_rows))
            }
    return state


def hf_config(shape: ModelShape) -> dict:
    return {
        "num_hidden_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "attention_bias": shape.attention_bias,
    }


def write_snapshot(
    checkpoint_dir: Path, step: int, shape: ModelShape, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """A complete snapshot as the trainer writes it: DCP files, config.json, weightcast.json."""
    path = checkpoint_dir / snapshot_name(step)
    state = hf_state(shape, torch.bfloat16) if state is None else state
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    (path / "config.json").write_text(json.dumps(hf_config(shape)))
    SnapshotInfo(uuid.uuid4().hex, "test-run", step, time.time(), "bfloat16", "test").write(path)
    return path


def clean_env() -> dict[str, str]:
    """This process's environment without WEIGHTCAST_* settings, as a new user's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCAST_")}


def weightcast(*args: str) -> list[str]:
    """argv that runs the weightcast CLI with this interpreter."""
    return [sys.executable, "-m", "shared.cli", *args]


def run_weightcast(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        weightcast(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


_SHARDED_SAVE = """
import sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in load_file(sys.argv[1]).items()}
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[2]))
dist.barrier()
dist.destroy_process_group()
"""


def write_sharded_snapshot(
    checkpoint_dir: Path, step: int, shape: ModelShape, state: dict[str, torch.Tensor], ranks: int
) -> Path:
    """A snapshot written by ``ranks`` gloo processes, every tensor sharded along dim 0 (FSDP)."""
    from safetensors.torch import save_file

    from shared.redis_server import free_port

    path = checkpoint_dir / snapshot_name(step)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    source = checkpoint_dir / f"state-{step}.safetensors"
    save_file(state, str(source))
    for _attempt in range(3):  # gloo start-up sometimes aborts on a loaded 2-core machine
        shutil.rmtree(path, ignore_errors=True)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(ranks),
                "--master_port",
                str(free_port()),
                "--no-python",
                sys.executable,
                "-c",
                _SHARDED_SAVE,
                str(source),
                str(path),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode == 0:
            break
    assert result.returncode == 0, result.stderr[-3000:]
    source.unlink()
    (path / "config.json").write_text(json.dumps(hf_config(shape)))
    SnapshotInfo(uuid.uuid4().hex, "test-run", step, time.time(), "bfloat16", "test").write(path)
    return path


def publish_snapshot(
    checkpoint_dir: Path, step: int, shape: ModelShape, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write a snapshot aside and rename it into ``checkpoint_dir``, as the trainer does, so a
    running publisher never sees it half-written."""
    staging = checkpoint_dir.parent / f"staging-{uuid.uuid4().hex[:8]}"
    written = write_snapshot(staging, step, shape, state)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / written.name
    os.rename(written, final)
    staging.rmdir()
    return final
