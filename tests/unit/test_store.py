"""The store's pure parts: locations, the cut of a read into ranged GETs, S3 answers to error
types, and the factory (the transports themselves: tests/integration/test_s3_store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from weightcast.contract.errors import (
    ConfigError,
    ObjectMissing,
    StoreAccessDenied,
    StoreFull,
    StoreUnavailable,
    WeightsError,
)
from weightcast.runtime.settings import load_config
from weightcast.store.directory import DirectoryStore
from weightcast.store.factory import open_store
from weightcast.store.s3 import PART_BYTES, S3Location, _ranges
from weightcast.store.s3_replies import store_error


def test_a_location_carries_bucket_prefix_and_server_options() -> None:
    url = "s3://rl-weights/runs/42?endpoint_url=http%3A%2F%2F10.0.0.5%3A8333&addressing_style=path"
    location = S3Location.parse(url)
    assert (location.bucket, location.prefix) == ("rl-weights", "runs/42/")
    assert (location.endpoint_url, location.addressing_style) == ("http://10.0.0.5:8333", "path")
    assert location.label == "s3://rl-weights/runs/42/"
    assert S3Location.parse("s3://rl-weights").prefix == ""


@pytest.mark.parametrize(
    "url",
    [
        "s3://key:secret@rl-weights/run",  # credentials never travel in a URL
        "s3://rl-weights/run?password=x",  # an option it does not know
        "s3://rl-weights/run?addressing_style=sideways",
        "s3://rl-weights/../other",
        "s3://rl-weights/a//b",
        "http://rl-weights/run",
        "s3:///run",
    ],
)
def test_a_location_that_cannot_be_used_is_refused_in_one_line(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        S3Location.parse(url)
    assert "\n" not in str(refused.value)
    assert "secret" not in str(refused.value)


def test_the_settings_make_one_location_string_for_every_process_of_a_node() -> None:
    config = load_config(
        env={},
        overrides={
            "weights_url": "s3://rl-weights/run",
            "s3_endpoint_url": "http://127.0.0.1:8333",
            "s3_region": "eu-west-1",
            "s3_addressing_style": "path",
        },
    )
    location = S3Location.parse(config.common.weights_location())
    assert location == S3Location(
        "rl-weights", "run/", "http://127.0.0.1:8333", "eu-west-1", "path"
    )
    plain = load_config(env={}, overrides={"weights_dir": "/data/weights"})
    assert plain.common.weights_location() == "/data/weights"


@pytest.mark.parametrize("url", ["s3://UPPER/run", "s3://x", "s3://rl-weights/run?region=x"])
def test_a_weights_url_setting_is_checked_when_loaded(url: str) -> None:
    with pytest.raises(ConfigError):
        load_config(env={}, overrides={"weights_url": url})


def test_the_factory_opens_a_directory_or_a_bucket_and_refuses_other_schemes(
    tmp_path: Path,
) -> None:
    assert isinstance(open_store(tmp_path), DirectoryStore)
    with pytest.raises(ConfigError, match="S3-compatible"):
        open_store("gs://bucket/run")


@pytest.mark.parametrize(
    "sizes",
    [[10], [PART_BYTES], [PART_BYTES + 1], [3, PART_BYTES - 3, 7], [PART_BYTES * 2 + 5, 1, 0]],
)
def test_a_read_is_cut_into_gets_of_at_most_a_part_that_tile_the_buffers(
    sizes: list[int],
) -> None:
    buffers = [memoryview(bytearray(n)) for n in sizes]
    gets = list(_ranges(buffers, 1000))
    assert all(0 < sum(len(v) for v in views) <= PART_BYTES for _, views in gets)
    at = 1000
    for offset, views in gets:  # consecutive, no gap, no overlap
        assert offset == at
        at += sum(len(v) for v in views)
    assert at == 1000 + sum(sizes)
    for index, (_, views) in enumerate(gets):  # every get but the last is a whole part
        if index < len(gets) - 1:
            assert sum(len(v) for v in views) == PART_BYTES


def _answer(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "GetObject",
    )


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (_answer("AccessDenied", 403), StoreAccessDenied),
        (_answer("NoSuchBucket", 404), StoreAccessDenied),
        (_answer("InvalidAccessKeyId", 403), StoreAccessDenied),
        (_answer("", 403), StoreAccessDenied),  # a HEAD's answer has no body
        (_answer("SlowDown", 503), StoreUnavailable),
        (_answer("", 500), StoreUnavailable),
        (_answer("WhoKnows", 502), StoreUnavailable),
        (_answer("QuotaExceeded", 403), StoreFull),
        (_answer("", 507), StoreFull),
        (_answer("NoSuchKey", 404), ObjectMissing),
        (_answer("", 404), ObjectMissing),
        (_answer("PreconditionFailed", 412), WeightsError),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StoreUnavailable),
        (NoCredentialsError(), StoreAccessDenied),
    ],
)
def test_each_answer_of_the_store_becomes_one_error_type(exc: Exception, kind: type) -> None:
    error = store_error(exc, "reading v3/model.vllm-fused")
    assert type(error) is kind
    assert str(error).startswith("reading v3/model.vllm-fused: ")


def test_what_is_no_answer_of_the_store_is_left_alone() -> None:
    assert store_error(KeyError("x"), "listing") is None
