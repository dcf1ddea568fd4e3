"""A stand-in for ``sgl_kernel``, SGLang's compiled kernels, which PyPI has for CUDA only.

SGLang 0.5.23 imports names from ``sgl_kernel`` at import time even with
``SGLANG_USE_CPU_ENGINE=1`` (``copy_all_layer_kv_cache_cpu``, ``rmsnorm``, ...); the real CPU
build is compiled from SGLang's source. On a CPU without AMX SGLang then runs its torch-native
paths and never calls them. This package lets the imports succeed: every name is a function
that records its call (one line in the file ``$WEIGHTCAST_SGL_KERNEL_CALLS``, which the tier's
tests assert stays empty) and raises, so a kernel SGLang did call cannot go unnoticed.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

CALLS_ENV = "WEIGHTCAST_SGL_KERNEL_CALLS"
__version__ = "0.0.0+weightcast-stand-in"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        path = os.environ.get(CALLS_ENV)
        if path:
            with open(path, "a") as calls:
                calls.write(f"{name} (pid {os.getpid()})\n")
        raise RuntimeError(f"sgl_kernel stand-in: {name} was called (no CPU kernel here)")

    kernel.__name__ = name
    return kernel
