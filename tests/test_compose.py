"""compose.yaml and the Dockerfile: valid against the compose spec and consistent inside.

No Docker engine runs here, so the file is checked against the compose-spec JSON schema and
its cross references (services, volumes, paths, commands) are checked by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from shared.cli import build_parser

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


def test_service_commands_are_valid_weightcast_invocations(compose: dict) -> None:
    parser = build_parser()
    for name in ("trainer", "publisher"):
        argv = [
            re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)
            for arg in compose["services"][name]["command"]
        ]
        args = parser.parse_args(argv)
        assert args.command == name


def test_dockerfile_copies_paths_that_exist_and_runs_weightcast() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
    assert 'ENTRYPOINT ["weightcast"]' in dockerfile
    assert "ARG TORCH_INDEX_URL" in dockerfile  # the CPU build argument
