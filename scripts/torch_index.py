"""Print the pip arguments that choose where ``make setup`` gets torch, or nothing.

PyPI's Linux torch is the CUDA build, with several GB of NVIDIA libraries: useless on a
machine without an NVIDIA GPU. There PyTorch's own CPU index is used when it answers; when it
does not (offline, a proxy, a local mirror in pip's configuration) pip's default is kept.

    python scripts/torch_index.py    # "--index-url https://download.pytorch.org/whl/cpu" or ""
"""

import platform
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NVIDIA_SIGNS = ("proc/driver/nvidia/version", "dev/nvidia0", "dev/nvidiactl")
"""Files an NVIDIA driver creates, relative to the root."""


def has_nvidia_gpu(
    root: Path = Path("/"), which: Callable[[str], str | None] = shutil.which
) -> bool:
    """Whether this machine has an NVIDIA driver (its device files, or ``nvidia-smi``)."""
    return any((root / sign).exists() for sign in NVIDIA_SIGNS) or which("nvidia-smi") is not None


def reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether ``url`` answers with a success within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url + "/torch/", timeout=timeout) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return False


def torch_pip_args(system: str, nvidia: bool, index_answers: Callable[[str], bool]) -> list[str]:
    """``--index-url`` of the CPU index on Linux without an NVIDIA GPU when it answers; else
    nothing (pip's default: CUDA on Linux, the CPU build elsewhere)."""
    if system != "Linux" or nvidia or not index_answers(CPU_INDEX):
        return []
    return ["--index-url", CPU_INDEX]


if __name__ == "__main__":
    print(" ".join(torch_pip_args(platform.system(), has_nvidia_gpu(), reachable)))
