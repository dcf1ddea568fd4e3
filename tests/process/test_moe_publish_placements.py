"""The ``tiny-moe`` trainer's snapshot published by the real publisher for vLLM's expert
parallelism at tp 2 (``--tp 2 --expert-parallel --layout both``): the manifest names the
placement, and each rank's contiguous block of every ``w13_weight`` / ``w2_weight`` is what
``FusedMoE``'s loader gives that rank from the HF tensors beside it (``vllm_reference``)."""

from __future__ import annotations

from pathlib import Path

import redis
from safetensors.torch import load_file

from weightcast.contract.experts import FUSED_MOE
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.sharding import ShardKind, rank_slice

from helpers.models import checkpoint_tensors
from helpers.processes import run_weightcast
from helpers.redis_state import push_batches
from vllm_reference import fused_moe_rank


def test_the_tiny_moe_snapshot_publishes_for_expert_parallel_ranks(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 2, vocab_size=1024)
    trained = run_weightcast(cli_env, "trainer", "--model", "tiny-moe", "--steps", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    published = run_weightcast(
        cli_env, "publisher", "--tp", "2", "--expert-parallel", "--layout", "both", "--once"
    )
    assert published.returncode == 0, published.stderr[-3000:]
    version = tmp_path / "weights" / "v1"
    manifest = Manifest.read(version)
    verify_files(version, manifest)
    assert (manifest.tp, manifest.ep) == (2, 2)
    hf, fused = checkpoint_tensors(version / "hf"), load_file(str(version / FUSED_WEIGHTS_FILE))
    experts = [t for t in manifest.tensors if t.shard.kind == ShardKind.EXPERTS]
    assert len(experts) == 2 * sum(f"{FUSED_MOE}.w13_weight" in t.name for t in experts) > 0
    for entry in experts:
        layer = entry.name.removesuffix(f".{FUSED_MOE}.{entry.name.rsplit('.', 1)[1]}")
        count = sum(f"{layer}.mlp.experts." in n and n.endswith("gate_proj.weight") for n in hf)
        sources = [
            [hf[f"{layer}.mlp.experts.{e}.{x}_proj.weight"] for e in range(count)]
            for x in ("gate", "up", "down")
        ]
        for rank in range(2):
            part = rank_slice(entry.shard, entry.shape, rank, 2)
            assert part is not None
            w13, w2 = fused_moe_rank(*sources, 2, rank, True)
            want = w13 if entry.name.endswith("w13_weight") else w2
            assert fused[entry.name][part.start : part.stop].equal(want), (entry.name, rank)
