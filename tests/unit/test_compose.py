"""compose.yaml and the Dockerfile: valid against the compose spec and consistent inside.

No Docker engine runs here, so the file is checked against the compose-spec JSON schema and
its cross references (services, volumes, paths, commands) are checked by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from weightcast.cli.main import build_parser

from helpers import REPO

COMPOSE = REPO / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_matches_the_compose_spec_schema() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(COMPOSE),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_services_and_volumes_refer_to_things_that_exist(compose: dict) -> None:
    services = compose["services"]
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


def test_redis_keeps_data_and_its_healthcheck_really_checks_pong(compose: dict) -> None:
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert any(m.endswith(":/data") for m in redis["volumes"])
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli ping" in test and "PONG" in test
    for name in ("trainer", "publisher"):
        assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_trainer_reserves_a_gpu(compose: dict) -> None:
    devices = compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_daemons_share_the_directories_the_design_says(compose: dict) -> None:
    services = compose["services"]

    def mounts(name: str) -> dict[str, str]:
        return dict(m.split(":")[:2] for m in services[name]["volumes"])

    for name in ("trainer", "publisher"):
        env = services[name]["environment"]
        assert mounts(name)["checkpoints"] == env["WEIGHTCAST_CHECKPOINT_DIR"]
        assert env["WEIGHTCAST_REDIS_URL"].startswith("redis://redis:")
    assert (
        mounts("publisher")["weights"]
        == services["publisher"]["environment"]["WEIGHTCAST_WEIGHTS_DIR"]
    )
    assert "weights" not in mounts("trainer")
    # Resume checkpoints outlive the container, under a stable consumer name (the host name).
    trainer = services["trainer"]
    assert mounts("trainer")["resume"] == trainer["environment"]["WEIGHTCAST_TRAINER_RESUME_DIR"]
    assert trainer["hostname"] == "trainer"


def parse_command(service: dict):
    """The service's command as ``weightcast`` parses it, ``${VAR:-default}`` expanded."""
    argv = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg) for arg in service["command"]]
    return build_parser().parse_args(argv)


def test_service_commands_are_valid_weightcast_invocations(compose: dict) -> None:
    services = compose["services"]
    expected = {
        "trainer": "trainer",
        "publisher": "publisher",
        "producer": "follow",
        "follower": "follow",
    }
    assert set(services) - {"redis"} == set(expected)
    for name, command in expected.items():
        assert parse_command(services[name]).command == command, name


def test_daemon_healthchecks_probe_the_healthz_port_the_daemon_serves(compose: dict) -> None:
    for name in ("trainer", "publisher"):
        service = compose["services"][name]
        port = vars(parse_command(service))[f"{name}.metrics_port"]
        probe = " ".join(service["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/healthz" in probe, name
        assert service["healthcheck"]["start_period"]  # torch import time is not a failure
        assert service["restart"] == "unless-stopped"


def test_demo_profile_runs_a_rollout_producer_and_a_follower(compose: dict) -> None:
    services = compose["services"]
    demo = {name for name, s in services.items() if "demo" in s.get("profiles", [])}
    assert demo == {"producer", "follower"}
    assert all("profiles" not in services[n] for n in ("redis", "trainer", "publisher"))
    assert vars(parse_command(services["producer"]))["follow.rollout"] is True
    assert "follow.rollout" not in vars(parse_command(services["follower"]))
    for name in demo:
        service = services[name]
        weights_dir = service["environment"]["WEIGHTCAST_WEIGHTS_DIR"]
        assert f"weights:{weights_dir}:ro" in service["volumes"], name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["environment"]["WEIGHTCAST_REDIS_URL"].startswith("redis://redis:")


def test_dockerfile_copies_paths_that_exist_and_runs_weightcast() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    assert 'ENTRYPOINT ["weightcast"]' in dockerfile
    assert "ARG TORCH_INDEX_URL" in dockerfile  # the CPU build argument
    assert 'pip install ".[demo]"' in dockerfile  # transformers, for follow --rollout
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("transformers") for d in extras["optional-dependencies"]["demo"])
