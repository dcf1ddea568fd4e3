"""Test helpers: synthetic HF state dicts and snapshots, and the weightcast CLI as a process."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from weightcast.client.producer import BatchProducer
from weightcast.client.weights import WeightsClient
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, ModelShape, fused_rank_file, rank_slice
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, file_entry, sha256_bytes
from weightcast.contract.snapshots import SnapshotInfo, snapshot_name
from weightcast.local.produce import synthetic_batch
from weightcast.publisher.daemon import Publisher
from weightcast.runtime.config import load_config
from weightcast.runtime.net import free_port
from weightcast.trainer.resume import TrainState, newest_checkpoint, read_train_state

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
    return [sys.executable, "-m", "weightcast", *args]


def run_weightcast(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        weightcast(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


SMALL_GQA = shape_of(4, 2, 8, hidden=16, inter=32)
"""4 heads over 2 kv heads: tp 1, 2 and 4 are valid, and tp 4 replicates kv heads."""


class Deployment:
    """The real publisher, driven one snapshot at a time, plus readers of its versions."""

    def __init__(
        self, client: redis.Redis, keys: Keys, root: Path, redis_url: str, tp: int = 1
    ) -> None:
        self.client, self.keys, self.root, self.redis_url = client, keys, root, redis_url
        settings = {
            "redis_url": redis_url,
            "namespace": keys.namespace,
            "checkpoint_dir": root / "checkpoints",
            "weights_dir": root / "weights",
            "publisher.tp": tp,
        }
        self.publisher = Publisher(load_config(env={}, overrides=settings))
        self.registry, self.evictor = self.publisher.registry, self.publisher.evictor
        self.step = 0

    def publish(self) -> int:
        """Write the next snapshot and run one publisher pass: publish, evict, prune."""
        self.step += 1
        write_snapshot(self.root / "checkpoints", self.step, SMALL_GQA)
        self.publisher.scan_once()
        return int(self.client.get(self.keys.latest))

    def reader(self, node_id: str = "node-a", lease_seconds: float = 30.0) -> WeightsClient:
        return WeightsClient(
            self.redis_url,
            self.keys.namespace,
            node_id,
            self.root / "weights",
            lease_seconds=lease_seconds,
        )


def split_per_rank(deployment: Deployment, version: int) -> int:
    """Register a copy of ``version`` with per-rank files, as ``--per-rank-files`` writes it:
    rank r's file holds, under the fused names, what ``rank_slice`` gives rank r."""
    client, keys = deployment.client, deployment.keys
    fields = client.hgetall(keys.version(version))
    source = Path(fields[b"path"].decode())
    manifest = Manifest.read(source)
    tensors = load_file(str(source / FUSED_WEIGHTS_FILE))
    target = source.parent / f"v{version}-per-rank"
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    entries, files = [], [file_entry(target / "config.json")]
    for rank in range(manifest.tp):
        name = fused_rank_file(rank, manifest.tp)
        parts = {}
        for entry in manifest.tensors:
            part = rank_slice(entry.shard, entry.shape, rank, manifest.tp)
            full = tensors[entry.name]
            parts[entry.name] = (
                full if part is None else full.narrow(part.dim, part.start, part.stop - part.start)
            ).contiguous()
            entries.append(
                dataclasses.replace(
                    entry, file=name, shape=list(parts[entry.name].shape), rank=rank
                )
            )
        save_file(parts, str(target / name))
        files.append(file_entry(target / name))
    text = (
        dataclasses.replace(manifest, files=files, tensors=entries, per_rank_files=True)
        .to_json()
        .encode()
    )
    (target / MANIFEST_NAME).write_bytes(text)
    copy = version + 100
    client.hset(
        keys.version(copy),
        mapping={**fields, b"path": str(target), b"manifest_sha256": sha256_bytes(text)},
    )
    client.zadd(keys.versions, {copy: copy})
    return copy


def push_batches(
    redis_url: str,
    keys: Keys,
    count: int,
    policy_version: int = 0,
    prefix: str = "b",
    seed: int = 0,
) -> dict[str, str]:
    """Push ``count`` valid batches, each with a unique ``meta.uid``; stream id -> uid."""
    producer = BatchProducer(redis_url, keys.namespace, name="test-producer", max_pending=0)
    generator = torch.Generator().manual_seed(seed)
    pushed = {}
    for index in range(count):
        uid = f"{prefix}{index}"
        tensors = synthetic_batch(generator, batch_size=2, seq_len=16, vocab_size=1024)
        pushed[producer.push(tensors, policy_version, uid=uid)] = uid
    return pushed


def final_train_state(resume_dir: Path) -> TrainState:
    """The train state of the newest complete resume checkpoint."""
    found = newest_checkpoint(resume_dir)
    assert found is not None, f"no complete resume checkpoint in {resume_dir}"
    return read_train_state(found[1])


def checkpoint_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a resume checkpoint (no optimizer, schedule or train state)."""
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in meta.items()
        if hasattr(item, "size") and not name.startswith(("optimizer", "lr_scheduler", "train"))
    }
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    """Poll ``condition`` until it returns something true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)
    return result


def torchrun(nproc: int, *args: str) -> list[str]:
    """argv of ``torchrun --nproc_per_node <nproc> <args>`` on a free master port."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    return [*command, "--master_port", str(free_port()), *args]


def run_torchrun_trainer(
    env: dict[str, str], nproc: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node <nproc> -m weightcast.trainer <args>`` on a free master port."""
    command = torchrun(nproc, "-m", "weightcast.trainer", *args)
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


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
    path = checkpoint_dir / snapshot_name(step)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    source = checkpoint_dir / f"state-{step}.safetensors"
    save_file(state, str(source))
    for _attempt in range(3):  # gloo start-up sometimes aborts on a loaded 2-core machine
        shutil.rmtree(path, ignore_errors=True)
        result = subprocess.run(
            torchrun(
                ranks, "--no-python", sys.executable, "-c", _SHARDED_SAVE, str(source), str(path)
            ),
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


def rank_part(tensor: torch.Tensor, shard: Mapping[str, Any], rank: int, tp: int) -> torch.Tensor:
    """What tp rank ``rank`` holds of a published ``tensor`` (``layout.rank_slice``), a view."""
    part = rank_slice(shard, list(tensor.shape), rank, tp)
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)
