"""What Docker Compose makes of compose.yaml, compose.gpu.yaml and the committed .env
(`docker compose config`; no engine needed): the profiles plain `up` starts, the GPU
override's merge, the build arguments and the vllm profile, which cannot run on a machine
without an NVIDIA GPU and Docker Hub. WEIGHTCAST_COMPOSE=<binary> checks another version.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from compose_harness import REPO, run

pytestmark = pytest.mark.docker

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LOOP = {"redis", "trainer", "publisher", "producer", "follower"}
VLLM = {"inference", "vllm-follower"}
S3 = {"s3", "s3-follower"}
GPU_FILES = ("compose.yaml", "compose.gpu.yaml")


def compose_config(compose_cli: list[str], files: tuple[str, ...], variables: dict, *argv: str):
    """`config` run in the repository with only ``variables`` set over an environment cleared
    of COMPOSE_* and WEIGHTCAST_* (so the committed .env applies; ``ENV_FILE`` among the
    variables: `--env-file` that file instead)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("COMPOSE_", "WEIGHTCAST_"))
    }
    variables = dict(variables)
    env_file = variables.pop("ENV_FILE", None)
    files_argv = ["--env-file", env_file] if env_file else []
    files_argv += [arg for f in files for arg in ("-f", f)]
    return run(*compose_cli, *files_argv, "config", *argv, cwd=REPO, env=env | variables).stdout


def config(compose_cli: list[str], *files: str, **variables: str) -> dict[str, Any]:
    """The project as Compose resolves it (some versions list every service here, whatever
    the profiles: ask `services` which ones run)."""
    return json.loads(compose_config(compose_cli, files, variables, "--format", "json"))


def services(compose_cli: list[str], *files: str, **variables: str) -> set[str]:
    """The services `up` starts."""
    return set(compose_config(compose_cli, files, variables, "--services").split())


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def build_args(service: dict[str, Any]) -> dict[str, str]:
    """Build args as a mapping (some Compose versions print ``NAME=value`` lists)."""
    args = service["build"]["args"]
    return dict(a.split("=", 1) for a in args) if isinstance(args, list) else args


def test_plain_up_runs_the_whole_loop_and_an_empty_profile_only_the_daemons(compose_cli) -> None:
    assert services(compose_cli) == LOOP
    assert services(compose_cli, COMPOSE_PROFILES="") == {"redis", "trainer", "publisher"}
    assert services(compose_cli, *GPU_FILES, COMPOSE_PROFILES="demo,vllm") == LOOP | VLLM
    trainer = config(compose_cli)["services"]["trainer"]
    assert "deploy" not in trainer, "CPU by default: no GPU reserved"
    assert build_args(trainer)["TORCH_INDEX_URL"] == CPU_INDEX


def test_gpu_override_keeps_services_volumes_commands_and_health_checks(compose_cli) -> None:
    profiles = "demo,vllm"
    cpu = config(compose_cli, COMPOSE_PROFILES=profiles)["services"]
    gpu = config(compose_cli, *GPU_FILES, COMPOSE_PROFILES=profiles)["services"]
    assert set(gpu) == set(cpu)
    for name in cpu:
        for key in ("volumes", "command", "healthcheck", "environment", "depends_on"):
            assert gpu[name].get(key) == cpu[name].get(key), (name, key)
    trainer = gpu["trainer"]
    (device,) = gpu_devices(trainer)
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    # PyPI's CUDA torch (Compose 2.18 loses an empty override and would keep the CPU index)
    assert build_args(trainer)["TORCH_INDEX_URL"] not in ("", CPU_INDEX)
    assert trainer["build"]["target"] == cpu["trainer"]["build"]["target"]
    runners = LOOP - {"redis"} | {"vllm-follower"}
    assert {gpu[name]["image"] for name in runners} == {"weightcast:gpu"}
    assert {cpu[name]["image"] for name in runners} == {"weightcast:latest"}


def test_build_arguments_and_images_come_from_the_environment(compose_cli) -> None:
    chosen = {
        "BASE_IMAGE": "example/python:3.12",
        "TORCH_SPEC": "torch==2.12.0",
        "TORCH_INDEX_URL": "",  # explicitly empty: PyPI
        "REDIS_IMAGE": "example/redis:8",
        "VLLM_IMAGE": "example/vllm:1",
        "WEIGHTCAST_IMAGE": "example/weightcast:1",
        "WEIGHTCAST_TARGET": "lean",
    }
    resolved = config(compose_cli, COMPOSE_PROFILES="demo,vllm", **chosen)["services"]
    trainer = resolved["trainer"]
    assert build_args(trainer) == {
        k: chosen[k] for k in ("BASE_IMAGE", "TORCH_SPEC", "TORCH_INDEX_URL")
    }
    assert trainer["build"]["target"] == "lean" and trainer["image"] == "example/weightcast:1"
    assert resolved["redis"]["image"] == "example/redis:8"
    assert build_args(resolved["inference"]) == {"VLLM_IMAGE": "example/vllm:1"}


def test_vllm_profile_serves_vllm_with_weightcast_and_follows_it(compose_cli) -> None:
    resolved = config(compose_cli, *GPU_FILES, COMPOSE_PROFILES="demo,vllm")["services"]
    inference, follower = resolved["inference"], resolved["vllm-follower"]
    assert inference["build"]["dockerfile"] == "vllm.Dockerfile"
    assert inference["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    command = inference["command"]
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {
        "backend": "weightcast"
    }
    assert gpu_devices(inference)[0]["driver"] == "nvidia"
    (port,) = inference["ports"]
    url = follower["command"][follower["command"].index("--vllm-url") + 1]
    assert url == f"http://inference:{port['target']}"
    assert follower["depends_on"]["inference"]["condition"] == "service_healthy"
    mounts = {m["source"]: m["target"] for m in inference["volumes"]}
    assert mounts["weights"] == follower["environment"]["WEIGHTCAST_WEIGHTS_DIR"]


def test_the_s3_env_file_adds_an_s3_server_and_a_follower_with_no_weights_volume(
    compose_cli,
) -> None:
    """`docker compose --env-file s3.env up`: the demo loop plus the s3 profile; every
    weightcast service gets the bucket, and the s3 follower has no volume at all."""
    assert services(compose_cli, ENV_FILE="s3.env") == LOOP | S3
    resolved = config(compose_cli, ENV_FILE="s3.env")["services"]
    for name in LOOP - {"redis"} | {"s3-follower"}:
        env = resolved[name]["environment"]
        assert env["WEIGHTCAST_WEIGHTS_URL"] == "s3://weights/demo", name
        assert env["WEIGHTCAST_S3_ENDPOINT_URL"] == "http://s3:8333", name
        assert env["WEIGHTCAST_S3_ADDRESSING_STYLE"] == "path", name
        assert env["AWS_ACCESS_KEY_ID"] == "weightcast", name
    follower = resolved["s3-follower"]
    assert not follower.get("volumes"), follower.get("volumes")
    assert follower["depends_on"]["s3"]["condition"] == "service_healthy"
    s3 = resolved["s3"]
    assert s3["build"]["dockerfile"] == "s3.Dockerfile"
    assert [m["source"] for m in s3["volumes"]] == ["s3-data"]
    assert not any(k.startswith("AWS_") for k in s3.get("environment") or {})  # weed: no identity
    # without it nothing changes: no S3 service, the weights volume, no keys
    plain = config(compose_cli)["services"]
    assert services(compose_cli) == LOOP
    assert plain["publisher"]["environment"]["WEIGHTCAST_WEIGHTS_URL"] == ""
    assert plain["publisher"]["environment"]["AWS_ACCESS_KEY_ID"] == ""
    # the shell's AWS keys never reach a container
    keyed = config(compose_cli, AWS_ACCESS_KEY_ID="AKIASHELL", AWS_SECRET_ACCESS_KEY="secret")
    assert "AKIASHELL" not in json.dumps(keyed)


def test_the_s3_profile_on_the_gpu_override_runs_the_gpu_image(compose_cli) -> None:
    resolved = config(compose_cli, *GPU_FILES, ENV_FILE="s3.env")["services"]
    assert resolved["s3-follower"]["image"] == "weightcast:gpu"
    assert resolved["s3"]["image"] == "weightcast:s3-server"
