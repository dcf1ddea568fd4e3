"""What stock vLLM engines started fresh from HF directories generate (the tier's references).

``python fresh_engine.py OUT.json TP MODEL...`` starts one stock engine (no weightcast
backend) per model, one after another, and writes their :func:`vllm_helpers.greedy` outputs.
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; at tp=1 the
worker too), so each engine starts in seconds instead of a minute: the numbers are the same
as a multi-process engine's, which the tests compare them with, at the same thread count.
An in-process worker binds no threads, so at tp=1 this process gets the one thread that
``conftest.tp_env`` gives the engines under test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(out: str, tp: str, *models: str) -> None:
    if int(tp) == 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool
    from vllm_helpers import greedy, llm_engine

    results = {}
    for model in models:
        extra = {"distributed_executor_backend": "uni"} if int(tp) == 1 else {}
        with llm_engine(model, int(tp), backend=False, **extra) as llm:
            results[model] = greedy(llm)
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
