"""Helpers of the SGLang tier: SGLang engines on CPU, and what they generate.

Runs in the SGLang venv (``.venv-sglang``: SGLang, weightcast editable with the publisher
extra). SGLang imports ``sgl_kernel`` even on CPU; :data:`STAND_IN` is the repository's
stand-in for it (``stand_in/sgl_kernel``), put on the path of every SGLang process here.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from helpers.servers import EngineServer, free_port

STAND_IN = Path(__file__).resolve().parent / "stand_in"
"""The folder holding the ``sgl_kernel`` stand-in."""

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700, 800], [3] * 12, [999, 17, 23]]


def sglang_env(calls: Path) -> dict[str, str]:
    """The environment an SGLang process of this tier needs: SGLang's CPU engine, the
    stand-in on the path, and where the stand-in records a call."""
    path = os.pathsep.join(p for p in (str(STAND_IN), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": path,
        "WEIGHTCAST_SGL_KERNEL_CALLS": str(calls),
    }


def engine_args(model: str | Path, **extra: Any) -> dict[str, Any]:
    """``sglang.Engine`` arguments for a tiny model on this CPU, deterministic, no tokenizer
    (what was found to run here: docs/sglang.md)."""
    return {
        "model_path": str(model),
        "device": "cpu",
        "skip_tokenizer_init": True,
        "attention_backend": "torch_native",
        "disable_cuda_graph": True,
        "max_total_tokens": 2048,
        "max_running_requests": 4,
        "mem_fraction_static": 0.05,
        "dtype": "bfloat16",
        "random_seed": 0,
        "port": free_port(),
        "log_level": "warning",
        **extra,
    }


@contextlib.contextmanager
def sglang_engine(model: str | Path, **extra: Any) -> Iterator[Any]:
    """An ``sglang.Engine`` started from ``model``'s HF directory (``extra``: arguments of
    :func:`engine_args` to override), shut down on exit.

    ``Engine.shutdown`` ends with ``kill_process_tree(os.getpid(), include_parent=False)``:
    it SIGKILLs every child of the calling process, the session's redis-server and S3 server
    included. Here it kills only the processes the engine started.
    """
    import psutil
    from sglang.srt.entrypoints import engine as engine_module
    from sglang.srt.utils.common import kill_process_tree

    import sglang

    me = psutil.Process()
    before = {child.pid for child in me.children()}
    engine = sglang.Engine(**engine_args(model, **extra))
    own = [child.pid for child in me.children() if child.pid not in before]

    def kill_own(parent_pid: int, include_parent: bool = True, **options: Any) -> None:
        for pid in own:
            kill_process_tree(pid, include_parent=True, **options)

    try:
        yield engine
    finally:
        with mock.patch.object(engine_module, "kill_process_tree", kill_own):
            engine.shutdown()
        del engine
        gc.collect()


def greedy(engine: Any) -> list[dict[str, Any]]:
    """Greedy tokens, their log-probabilities and every prompt token's, for :data:`PROMPTS`
    (one prompt per ``generate``: a batch runs other kernel shapes), from an ``sglang.Engine``
    or a :class:`Server`."""
    results = []
    for prompt in PROMPTS:
        out = engine.generate(
            input_ids=prompt,
            sampling_params={"temperature": 0.0, "max_new_tokens": 12},
            return_logprob=True,
            logprob_start_len=0,
        )
        meta = out["meta_info"]
        results.append(
            {
                "tokens": out["output_ids"],
                "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
                "prompt_logprobs": [lp for lp, _, _ in meta["input_token_logprobs"]],
            }
        )
    return results


@dataclass
class Server(EngineServer):
    """``python -m sglang.launch_server`` with the arguments of :func:`engine_args`."""

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1"]
        for name, value in {**engine_args(self.model), "port": self.port}.items():
            flag = "--" + name.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        return argv

    def generate(self, **request: Any) -> Any:
        """``/generate``, as ``sglang.Engine.generate`` takes and answers it."""
        return self.call("POST", "/generate", request)

    def weight_version(self) -> str:
        return str(self.call("GET", "/model_info")["weight_version"])
