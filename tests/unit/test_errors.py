"""One error tree: what weightcast raises across modules is a ``WeightcastError``, and whether
vLLM refused a version is a type."""

from __future__ import annotations

import pytest

from weightcast.client.vllm.driver import EngineError, VersionRefused, engine_error
from weightcast.client.vllm.protocol import REFUSED
from weightcast.contract.errors import WeightcastError
from weightcast.contract.snapshot_format import IncompleteSnapshot
from weightcast.contract.tensorfile import HeaderError
from weightcast.local.redis_server import RedisServerError
from weightcast.local.up import StackFailure
from weightcast_publisher.daemon import NotLeader
from weightcast_publisher.snapshot_scan import CorruptSnapshot


@pytest.mark.parametrize(
    "error",
    [
        NotLeader,
        EngineError,
        StackFailure,
        RedisServerError,
        IncompleteSnapshot,
        HeaderError,
        CorruptSnapshot,
    ],
)
def test_errors_raised_across_modules_are_weightcast_errors(error: type[Exception]) -> None:
    assert issubclass(error, WeightcastError)


def test_a_refused_version_is_told_from_an_engine_failure_by_its_type() -> None:
    refused = engine_error(f"POST /update_weights: HTTP 500: version 3 {REFUSED}: bad shape")
    failed = engine_error("POST /update_weights: HTTP 500: CUDA out of memory")
    assert isinstance(refused, VersionRefused)
    assert type(failed) is EngineError
