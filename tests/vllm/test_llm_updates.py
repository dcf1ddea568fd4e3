"""A real CPU ``vllm.LLM`` updated through the ``weightcast`` backend, against fresh engines.

Versions come from the real publisher (with deltas: an update by delta is checked the same
way). After each update the engine's greedy tokens and
prompt log-probabilities equal, exactly, those of a stock engine started fresh from the same
version's ``hf`` layout; a version the engine must not load is refused with the reason, and
the engine keeps serving, exactly, what it served before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from weightcast.client.engine import EngineError
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine

from conftest import Versions, assert_refused_and_unchanged
from vllm_helpers import PROMPTS, TINY, backend_engine, greedy


@pytest.fixture(scope="module")
def engine(tiny: Versions) -> Iterator[LocalEngine]:
    """A tp=1 engine (vLLM's default process layout: engine core and worker processes),
    started from version A's HF layout, with the weightcast backend."""
    with backend_engine(tiny.hf_dir("A"), tiny.registry, "llm-node") as engine:
        yield engine


@pytest.fixture(scope="module")
def fresh(tiny: Versions, fresh_outputs: Any) -> dict[str, Any]:
    by_dir = fresh_outputs(1, [tiny.hf_dir(name) for name in "ABC"])
    return {name: by_dir[tiny.hf_dir(name)] for name in "ABC"}


def worker_reports(engine: LocalEngine) -> list[dict[str, Any]]:
    from weightcast.client.vllm.backend import report

    return engine.llm.collective_rpc(report)


def test_updates_equal_fresh_engines_exactly(
    engine: LocalEngine, tiny: Versions, fresh: dict[str, Any]
) -> None:
    assert greedy(engine.llm) == fresh["A"]  # started from A's hf layout, as stock vLLM does
    assert fresh["A"] != fresh["B"] != fresh["C"]  # the versions differ where it shows
    for name in ("B", "C", "B"):
        swap(engine, tiny.number[name])
        assert greedy(engine.llm) == fresh[name], name
        assert engine.weight_version() == str(tiny.number[name])
        (only,) = worker_reports(engine)
        assert only["version"] == tiny.number[name] and only["mode"] == "layerwise"  # CPU
        assert only["bytes"] == sum(t.nbytes for t in tiny.states[name].values())
        # C's delta is from B, which the worker then holds: C loads by delta (rebuilt on the
        # host from the rank's base, verified); B's delta is from A, which it never held.
        assert only["via"] == ("delta" if name == "C" else "full"), name
    swap(engine, tiny.number["A-hf"])  # the plain hf layout loads through the backend too
    assert greedy(engine.llm) == fresh["A"]
    assert worker_reports(engine)[0]["layout"] == "hf"
    # The backend's readers let go of their leases (the worker leases as <node>-tp<rank>).
    assert all(tiny.registry.leases(v) == [] for v in tiny.number.values())


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("B-tp2", r"WeightsError: version \d+ is fused for tp=2; this engine runs tp=1"),
        ("other-model", r"WeightsError: version \d+ is a different model"),
        ("B-corrupt", r"WeightsError: .*model\.vllm-fused: .*(sha256|digest|do not match)"),
        (
            "B-norm-as-qkv",
            r"WeightsError: .*manifest\.json: not a valid manifest \(tensors\[\d+\] "
            r"\(model\.norm\.weight\)\.shard does not fit its shape",
        ),
    ],
)
def test_a_refused_version_leaves_the_engine_serving_what_it_served(
    engine: LocalEngine, tiny: Versions, fresh: dict[str, Any], name: str, reason: str
) -> None:
    assert_refused_and_unchanged(engine, tiny, fresh, name, reason)


@pytest.mark.parametrize(
    ("update_info", "reason"),
    [
        ({"versoin": 3}, "unexpected keyword argument 'versoin'"),
        ({"version": 0}, "'version' must be an integer >= 1, got 0"),
        ({"version": "3"}, "'version' must be an integer >= 1, got '3'"),
        ({"version": 10_000}, "version 10000 is no longer live"),
    ],
)
def test_a_bad_update_info_is_refused_with_the_reason(
    engine: LocalEngine, tiny: Versions, fresh: dict[str, Any], update_info: Any, reason: str
) -> None:
    swap(engine, tiny.number["B"])
    engine.start_weight_update()
    with pytest.raises(EngineError, match=reason):
        engine.update_weights(update_info)
    with pytest.raises(EngineError, match="without a matching start_weight_update"):
        engine.finish_weight_update()  # at tp=1 the failure closed the session already
    assert greedy(engine.llm) == fresh["B"]


def transformers_logprobs(state: dict[str, torch.Tensor]) -> list[list[float]]:
    """Log-probability of each prompt token (after the first) from transformers, fp32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config.from_dict({**TINY, "torch_dtype": "float32"})).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    found = []
    with torch.no_grad():
        for prompt in PROMPTS:
            logits = model(torch.tensor([prompt])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            found.append([logp[i, t].item() for i, t in enumerate(prompt[1:])])
    return found


def test_prompt_logprobs_match_transformers_within_bf16_error(
    engine: LocalEngine, tiny: Versions
) -> None:
    swap(engine, tiny.number["B"])
    served = [o["prompt_logprobs"][1:] for o in greedy(engine.llm)]

    def worst(reference: list[list[float]]) -> float:
        return max(
            abs(a - b)
            for mine, theirs in zip(served, reference, strict=True)
            for a, b in zip(mine, theirs, strict=True)
        )

    assert all(math.isfinite(x) for row in served for x in row)
    assert worst(transformers_logprobs(tiny.states["B"])) < 0.05  # bf16 engine, fp32 reference
    assert worst(transformers_logprobs(tiny.states["A"])) > 0.3  # another version is far off
