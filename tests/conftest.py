"""Shared fixtures and the test tiers.

Tiers by folder: ``unit`` (no processes, no Redis), ``integration`` (a real redis-server on a
free loopback port, in-process daemons, short CLI processes), ``process`` (real trainer and
publisher processes, marked ``slow``), ``vllm`` (real vLLM engines, marked ``vllm`` and
``slow``; collected only where vLLM is installed: ``make test-vllm`` runs them with the
``.venv-vllm`` pytest), ``sglang`` (real SGLang engines, likewise: ``make test-sglang``,
``.venv-sglang``), ``realsize`` (``tests/realsize`` and ``tests/vllm/realsize``: every
node path at Qwen3-0.6B's real shape, marked ``realsize`` and ``slow``; ``make test-realsize``,
which ``make test`` runs last). ``gpu`` tests are skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server
from weightcast_trainer.device import use_cpu_without_accelerator

from helpers.processes import run_env
from helpers.realsize import RealSizeVersions, published
from helpers.s3 import unique_bucket

use_cpu_without_accelerator()  # before any test module imports torchtitan

REPO = Path(__file__).resolve().parent.parent
PROCESS_TIER = Path(__file__).resolve().parent / "process"
VLLM_TIER = Path(__file__).resolve().parent / "vllm"
SGLANG_TIER = Path(__file__).resolve().parent / "sglang"
REALSIZE_TIERS = (
    Path(__file__).resolve().parent / "realsize",
    Path(__file__).resolve().parent / "vllm" / "realsize",
)


def _installed(engine: str) -> bool:
    spec = importlib.util.find_spec(engine)
    return spec is not None and spec.origin is not None  # not tests/<engine> as a namespace


collect_ignore = [engine for engine in ("vllm", "sglang") if not _installed(engine)]


def pytest_report_header(config: pytest.Config) -> list[str]:
    make = {"vllm": "make test-vllm", "sglang": "make test-sglang"}
    return [
        f"tests/{e} not collected: {e} is not installed here ({make[e]} runs it)"
        for e in collect_ignore
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the process, vLLM and real-size tiers ``slow`` (and ``vllm``, ``realsize``); skip
    ``gpu`` tests when CUDA is not available."""
    import torch

    no_gpu = pytest.mark.skip(reason="needs CUDA; torch sees no GPU here")
    for item in items:
        if item.path.is_relative_to(PROCESS_TIER):
            item.add_marker(pytest.mark.slow)
        if item.path.is_relative_to(VLLM_TIER):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.vllm)
        if item.path.is_relative_to(SGLANG_TIER):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.sglang)
        if any(item.path.is_relative_to(tier) for tier in REALSIZE_TIERS):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.realsize)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server for the session; tests isolate themselves by namespace."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_server.url)
    yield connection
    connection.close()


@pytest.fixture
def cli_env(redis_server: RedisServer, keys: Keys, tmp_path: Path) -> dict[str, str]:
    """Environment for ``weightcast`` subprocesses: this test's Redis, namespace, dirs."""
    return run_env(redis_server.url, keys.namespace, tmp_path)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One private S3 server (SeaweedFS) for the session; tests isolate themselves by bucket
    (``s3_bucket``). Tests that kill or fill a server take ``private_s3_server``."""
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def realsize(
    redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealSizeVersions]:
    """The real-size tier's 0.6B versions (``helpers.realsize``) in a bucket and the
    publisher's weights directory, each served one also as an HF directory (fresh vLLM
    engines start from them): published once for ``tests/realsize`` and
    ``tests/vllm/realsize``, which ``make test-realsize`` runs in one session."""
    root = tmp_path_factory.mktemp("realsize")
    with published(redis_server.url, s3_server, root, root / "hf") as versions:
        yield versions


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new bucket on the session's S3 server, for this test alone."""
    name = unique_bucket()
    s3_server.create_bucket(name)
    return name


@pytest.fixture
def private_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """An S3 server of this test's own (bucket ``weights``), for fault tests that kill,
    restart or fill it; stopped at the end (SIGKILL after 3 s: its data is not needed)."""
    with S3Server(tmp_path / "s3", grace=3.0) as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The session's S3 server in this test's environment (AWS_ENDPOINT_URL, dummy keys),
    undone after the test; the variables set."""
    env = s3_server.client_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
