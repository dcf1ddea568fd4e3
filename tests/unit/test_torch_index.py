"""Where ``make setup`` gets torch: PyTorch's CPU index on Linux without an NVIDIA GPU when it
answers, pip's default otherwise (scripts/torch_index.py)."""

from __future__ import annotations

import http.server
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcast.runtime.net import free_port

from helpers.servers import serving

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("torch_index", REPO / "scripts/torch_index.py")
assert spec is not None and spec.loader is not None
torch_index = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_index)

CPU = ["--index-url", torch_index.CPU_INDEX]


@pytest.mark.parametrize(
    ("system", "nvidia", "answers", "expected"),
    [
        ("Linux", False, True, CPU),
        ("Linux", False, False, []),  # offline or a mirror: pip's own configuration
        ("Linux", True, True, []),  # a GPU: PyPI's CUDA build
        ("Darwin", False, True, []),  # PyPI's wheel is the CPU build already
    ],
)
def test_the_cpu_index_only_on_linux_without_a_gpu_when_it_answers(
    system: str, nvidia: bool, answers: bool, expected: list[str]
) -> None:
    asked: list[str] = []

    def index_answers(url: str) -> bool:
        asked.append(url)
        return answers

    assert torch_index.torch_pip_args(system, nvidia, index_answers) == expected
    assert asked in ([], [torch_index.CPU_INDEX])


def test_an_nvidia_driver_is_seen_by_its_files_or_nvidia_smi(tmp_path: Path) -> None:
    assert not torch_index.has_nvidia_gpu(tmp_path, which=lambda _: None)
    assert torch_index.has_nvidia_gpu(tmp_path, which=lambda _: "/usr/bin/nvidia-smi")
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text("NVRM version: 570\n")
    assert torch_index.has_nvidia_gpu(tmp_path, which=lambda _: None)


@pytest.fixture
def index_server() -> Iterator[str]:
    """A real HTTP server on loopback that serves ``/torch/``."""

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/torch/" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serving(Index) as url:
        yield url


def test_an_index_is_reachable_when_it_answers(index_server: str) -> None:
    assert torch_index.reachable(index_server)
    assert not torch_index.reachable(index_server + "/missing")
    assert not torch_index.reachable(f"http://127.0.0.1:{free_port()}", timeout=2)
