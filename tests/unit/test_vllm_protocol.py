"""The backend's ``init_info`` / ``update_info``: what is accepted, and where fields come from."""

from __future__ import annotations

import pytest

from weightcast.client.engine import served_version
from weightcast.client.vllm.protocol import InitInfo, UpdateInfo, resolve
from weightcast.runtime.settings import load_config


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({}, TypeError),  # vLLM turns a TypeError into "Invalid update_info for ..."
        ({"versoin": 3}, TypeError),
        ({"version": 0}, ValueError),
        ({"version": True}, ValueError),
        ({"version": "3"}, ValueError),
        ({"version": 3.0}, ValueError),
        ({"version": 3, "redis_url": 5}, ValueError),
    ],
)
def test_an_update_info_names_one_version_by_number(payload: dict, error: type) -> None:
    with pytest.raises(error):
        UpdateInfo(**payload)


def test_init_info_refuses_an_unknown_load_mode() -> None:
    assert InitInfo(load_mode="layerwise").load_mode == "layerwise"
    with pytest.raises(ValueError, match="'load_mode' must be one of"):
        InitInfo(load_mode="fast")


def test_fields_come_from_the_update_then_the_init_info_then_the_settings() -> None:
    config = load_config(
        env={
            "WEIGHTCAST_REDIS_URL": "redis://settings:6379/0",
            "WEIGHTCAST_NAMESPACE": "fromenv",
            "WEIGHTCAST_WEIGHTS_DIR": "/env/weights",
            "WEIGHTCAST_FOLLOW_NODE_ID": "env-node",
        }
    )
    init = InitInfo(redis_url="redis://init:6379/0", weights_root="/init/weights")
    update = UpdateInfo(version=4, weights_root="/update/weights")
    source = resolve(update, init, config)
    assert source.redis_url == "redis://init:6379/0"
    assert source.weights_root == "/update/weights"  # a directory, or an s3:// URL
    assert (source.namespace, source.node_id) == ("fromenv", "env-node")
    assert resolve(UpdateInfo(version=4), InitInfo(), load_config(env={})).node_id  # host-pid


@pytest.mark.parametrize(("label", "version"), [("7", 7), ("default", 0), ("v7", 0), ("", 0)])
def test_the_version_vllm_reports_is_read_as_a_weightcast_version(label: str, version: int) -> None:
    assert served_version(label) == version
