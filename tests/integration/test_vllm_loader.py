"""The vLLM loader against parameters shaped, and loaders behaving, as vLLM's for tp 1, 2, 4.

vLLM does not run here. Each rank's parameters are built from vLLM's own sizing rules
(``QKVParallelLinear``: heads / tp, kv heads / tp or one replicated kv head when tp exceeds
them; ``MergedColumnParallelLinear``: intermediate / tp per half; ``RowParallelLinear``: input
columns / tp; ``VocabParallelEmbedding``: vocabulary padded to 64, then / tp), and the
``weight_loader`` attributes of the unfused ones behave like vLLM's (``tests/vllm_reference``
re-implements them independently of ``weightcast.contract.layout``). The fused ones refuse to be
called, as the loader must copy those blocks directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import torch
from torch import nn

from weightcast.client.vllm import WeightcastWorkerExtension, load_version, update_engine
from weightcast.contract.keys import Keys
from weightcast.contract.layout import LayoutError, ModelShape
from weightcast.local.redis_server import RedisServer

from helpers import SMALL_GQA, Deployment, hf_state, split_per_rank
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)

PADDING = 64


def must_not_be_called(*_args: object) -> None:
    raise AssertionError("a fused parameter's weight_loader was called; fused blocks are copied")


def param(shape: tuple[int, ...], loader) -> nn.Parameter:
    p = nn.Parameter(torch.full(shape, float("nan"), dtype=torch.bfloat16), requires_grad=False)
    p.weight_loader = loader  # as vLLM's set_weight_attrs does
    return p


def vllm_rank_model(shape: ModelShape, tp: int, rank: int) -> nn.Module:
    """One rank of vLLM's Qwen3ForCausalLM, as parameters named and sized the way vLLM does."""
    heads = shape.num_heads // tp
    kv_heads = 1 if tp >= shape.num_kv_heads else shape.num_kv_heads // tp
    hidden, d = shape.hidden_size, shape.head_dim
    padded_vocab = -(-shape.vocab_size // PADDING) * PADDING

    def copy(p: torch.Tensor, w: torch.Tensor) -> None:  # vLLM's default_weight_loader
        assert p.shape == w.shape, (p.shape, w.shape)
        p.data.copy_(w)

    def row_parallel(p: torch.Tensor, w: torch.Tensor) -> None:
        copy(p, row_parallel_rank(w, tp, rank))

    def vocab_parallel(p: torch.Tensor, w: torch.Tensor) -> None:
        copy(p, vocab_parallel_rank(w, tp, rank, PADDING))

    params = {
        "model.embed_tokens.weight": param((padded_vocab // tp, hidden), vocab_parallel),
        "model.norm.weight": param((hidden,), copy),
    }
    if not shape.tie_word_embeddings:
        params["lm_head.weight"] = param((padded_vocab // tp, hidden), vocab_parallel)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        params |= {
            f"{p}.self_attn.qkv_proj.weight": param(
                ((heads + 2 * kv_heads) * d, hidden), must_not_be_called
            ),
            f"{p}.self_attn.o_proj.weight": param((hidden, heads * d), row_parallel),
            f"{p}.self_attn.q_norm.weight": param((d,), copy),
            f"{p}.self_attn.k_norm.weight": param((d,), copy),
            f"{p}.mlp.gate_up_proj.weight": param(
                (2 * shape.intermediate_size // tp, hidden), must_not_be_called
            ),
            f"{p}.mlp.down_proj.weight": param(
                (hidden, shape.intermediate_size // tp), row_parallel
            ),
            f"{p}.input_layernorm.weight": param((hidden,), copy),
            f"{p}.post_attention_layernorm.weight": param((hidden,), copy),
        }
    return VllmRank(params)


class VllmRank(nn.Module):
    """Parameters under vLLM's dotted names (the loader only walks ``named_parameters``)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.by_name = params
        for index, value in enumerate(params.values()):
            self.register_parameter(f"p{index}", value)

    def named_parameters(self, *_args: object, **_kwargs: object):
        return iter(self.by_name.items())


def expected_rank(shape: ModelShape, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's own loaders, fed the HF checkpoint, leave in each parameter of ``rank``."""
    state = hf_state(shape, torch.bfloat16)
    expected = {}
    for name, tensor in state.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            q, k, v = (state[name.replace("q_proj", x)] for x in ("q_proj", "k_proj", "v_proj"))
            expected[name.replace("q_proj", "qkv_proj")] = qkv_parallel_rank(
                q, k, v, shape.num_heads, shape.num_kv_heads, shape.head_dim, tp, rank
            )
        elif ".gate_proj." in name:
            up = state[name.replace("gate_proj", "up_proj")]
            expected[name.replace("gate_proj", "gate_up_proj")] = merged_column_parallel_rank(
                tensor, up, tp, rank
            )
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected[name] = vocab_parallel_rank(tensor, tp, rank, PADDING)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            expected[name] = row_parallel_rank(tensor, tp, rank)
        else:
            expected[name] = tensor
    return expected


@pytest.mark.parametrize("per_rank_files", [False, True], ids=["fused-file", "per-rank-files"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_holds_what_vllms_loaders_would_put_there(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    tp: int,
    per_rank_files: bool,
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=tp)
    version = deployment.publish()
    if per_rank_files:
        version = split_per_rank(deployment, version)
    reader = deployment.reader()
    for rank in range(tp):
        model = vllm_rank_model(SMALL_GQA, tp, rank)
        loaded = load_version(model, reader, version, rank, tp)
        params = dict(model.named_parameters())
        assert sorted(loaded) == sorted(params)
        for name, tensor in expected_rank(SMALL_GQA, tp, rank).items():
            assert torch.equal(params[name], tensor), (name, rank)


def test_an_engine_with_another_tp_is_refused(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=2)
    version = deployment.publish()
    model = vllm_rank_model(SMALL_GQA, 4, 0)
    with pytest.raises(LayoutError, match="fused for tp=2 cannot serve tp=4"):
        load_version(model, deployment.reader(), version, 0, 4)
    assert torch.isnan(dict(model.named_parameters())["model.norm.weight"]).all()


class StandInWorker(WeightcastWorkerExtension):
    """What vLLM gives the extension: ``model_runner.model`` and its tp rank."""

    def __init__(self, model: nn.Module, rank: int, tp: int) -> None:
        self.model_runner = SimpleNamespace(model=model)
        self.rank, self.tp = rank, tp

    def weightcast_tp(self) -> tuple[int, int]:
        return self.rank, self.tp


class StandInLLM:
    """``vllm.LLM``'s two methods the driver uses, recording the order they run in."""

    def __init__(self, workers: list[StandInWorker]) -> None:
        self.workers, self.calls = workers, []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(method)
        return [getattr(worker, method)(*args) for worker in self.workers]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


def test_update_engine_loads_every_worker_then_resets_the_prefix_cache(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=2)
    version = deployment.publish()
    workers = [StandInWorker(vllm_rank_model(SMALL_GQA, 2, r), r, 2) for r in range(2)]
    llm = StandInLLM(workers)
    result = update_engine(
        llm, redis_server.url, keys.namespace, version, "engine-a", str(tmp_path / "weights")
    )
    assert llm.calls == ["weightcast_load", "reset_prefix_cache"]
    assert result["workers"] == 2 and result["tensors"] == len(expected_rank(SMALL_GQA, 2, 0))
    for rank, worker in enumerate(workers):
        params = dict(worker.model_runner.model.named_parameters())
        for name, tensor in expected_rank(SMALL_GQA, 2, rank).items():
            assert torch.equal(params[name], tensor), (name, rank)
    assert json.loads(client.hget(keys.nodes, "engine-a"))["version"] == version
    assert client.zcard(keys.leases(version)) == 0  # each rank's lease released
