"""Test helpers: synthetic HF state dicts and snapshots, the weightcast CLI as a process, and
what the trainer tests read back (train state, heartbeat, dead letters)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import redis
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save, save_file

from weightcast.client.producer import BatchProducer
from weightcast.client.weights import WeightsClient
from weightcast.contract.codec import BATCH_FIELD, META_FIELD
from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file
from weightcast.contract.manifest import (
    BLOCK_BYTES,
    DEFAULT_DIGEST,
    MANIFEST_FORMAT,
    MANIFEST_FORMATS,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    file_digests,
    file_entry,
    sha256_bytes,
    sha256_file,
)
from weightcast.contract.model_shape import ConfigExtras, ModelShape, hf_tensor_shapes
from weightcast.contract.sharding import Shard, rank_slice
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    SnapshotFile,
    SnapshotInfo,
    snapshot_name,
)
from weightcast.local.produce import synthetic_batch
from weightcast.runtime.settings import load_config
from weightcast_publisher.daemon import Publisher
from weightcast_trainer.dcp_safetensors import SafetensorsStorageWriter
from weightcast_trainer.resume import (
    TrainState,
    newest_checkpoint,
    read_model_weights,
    read_train_state,
)

REPO = Path(__file__).resolve().parent.parent


def shape_of(
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int = 8,
    inter: int = 32,
    tied: bool = True,
    bias: bool = False,
) -> ModelShape:
    return ModelShape(
        num_layers=2,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=64,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )


def moe_shape(
    experts: int = 4, moe_inter: int = 16, dense_layers: tuple[int, ...] = (1,), layers: int = 3
) -> ModelShape:
    """A small Qwen3-MoE: 4 heads over 2 kv heads, ``dense_layers`` keep a dense MLP."""
    return dataclasses.replace(
        shape_of(4, 2, 8, hidden=16, inter=32),
        num_layers=layers,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
        mlp_only_layers=dense_layers,
    )


def hf_state(shape: ModelShape, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A random HF-named Qwen3 (or Qwen3-MoE) state dict of this shape (unique values, so
    swaps show)."""
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(*size, generator=gen).to(dtype)
        for name, size in hf_tensor_shapes(shape).items()
    }


def drift(state: dict[str, torch.Tensor], step: int, every: int = 50) -> None:
    """Move one bf16 value in ``every`` of each tensor to its neighbour, in place: what a
    small RL step does to a bf16 snapshot (most bytes stay; a delta is small)."""
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.int16)
        flat[step % every :: every] += 1


FORMATS = (FORMAT_DCP_SAFETENSORS, FORMAT_DCP_TORCH_SAVE)
"""Snapshot formats: what the trainer writes, and what earlier trainers wrote."""


def write_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor] | None = None,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """A complete snapshot as the trainer writes it (``dcp-safetensors/1``: the trainer's own
    storage writer) or as earlier trainers did (``dcp-torchsave``: DCP's FileSystemWriter)."""
    path = checkpoint_dir / snapshot_name(step)
    state = hf_state(shape, torch.bfloat16) if state is None else state
    files: tuple[SnapshotFile, ...] = ()
    if format == FORMAT_DCP_SAFETENSORS:
        path.mkdir(parents=True, exist_ok=True)
        storage = SafetensorsStorageWriter(path)
        dcp.save(state, storage_writer=storage, no_dist=True)
        files = tuple(storage.files)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return finish_snapshot(path, step, shape, format, files)


def finish_snapshot(
    path: Path, step: int, shape: ModelShape, format: str, files: tuple[SnapshotFile, ...]
) -> Path:
    """What the trainer writes once the tensors are saved: ``config.json``, then the info
    file that makes the snapshot complete."""
    (path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    info = SnapshotInfo(
        uuid.uuid4().hex, "test-run", step, time.time(), "bfloat16", "test", format, files
    )
    info.write(path)
    return path


def run_env(redis_url: str, namespace: str, root: Path) -> dict[str, str]:
    """Environment for ``weightcast`` processes: this Redis and namespace, the checkpoint and
    weights directories under ``root``."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WEIGHTCAST_REDIS_URL": redis_url,
        "WEIGHTCAST_NAMESPACE": namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(root / "checkpoints"),
        "WEIGHTCAST_WEIGHTS_DIR": str(root / "weights"),
    }


def with_namespace(env: dict[str, str], root: Path, name: str) -> dict[str, str]:
    """``env`` for a second run beside the test's own: namespace ``<namespace>-<name>`` on the
    same Redis, its directories under ``root / name``."""
    namespace = f"{env['WEIGHTCAST_NAMESPACE']}-{name}"
    return {**env, **run_env(env["WEIGHTCAST_REDIS_URL"], namespace, root / name)}


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Stop ``process`` with ``signum`` (SIGKILL if it outlives ``timeout``); its exit code."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


def clean_env() -> dict[str, str]:
    """This process's environment without WEIGHTCAST_* settings, as a new user's shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCAST_")}


def weightcast(*args: str) -> list[str]:
    """argv that runs the weightcast CLI with this interpreter."""
    return [sys.executable, "-m", "weightcast", *args]


def run_weightcast(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        weightcast(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def start_weightcast(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """Start ``weightcast <args>`` in the background, appending its output to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            weightcast(*args), env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )


def with_test_modules(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``tests/`` first on PYTHONPATH: a trainer can load ``poison_loss:loss``."""
    paths = [str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def config_file(tmp_path: Path, text: str, name: str = "trainer.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


SMALL_GQA = shape_of(4, 2, 8, hidden=16, inter=32)
"""4 heads over 2 kv heads: tp 1, 2 and 4 are valid, and tp 4 replicates kv heads."""


class Deployment:
    """The real publisher, driven one snapshot at a time, plus readers of its versions."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        root: Path,
        redis_url: str,
        tp: int = 1,
        shape: ModelShape = SMALL_GQA,
    ) -> None:
        self.client, self.keys, self.root, self.redis_url = client, keys, root, redis_url
        self.shape = shape
        settings = {
            "redis_url": redis_url,
            "namespace": keys.namespace,
            "checkpoint_dir": root / "checkpoints",
            "weights_dir": root / "weights",
            "publisher.tp": tp,
        }
        self.publisher = Publisher(load_config(env={}, overrides=settings))
        self.registry, self.evictor = self.publisher.registry, self.publisher.evictor
        self.step = 0

    def publish(self) -> int:
        """Write the next snapshot and run one publisher pass: publish, evict, prune."""
        self.step += 1
        write_snapshot(self.root / "checkpoints", self.step, self.shape)
        self.publisher.scan_once()
        return int(self.client.get(self.keys.latest))

    def reader(self, node_id: str = "node-a", lease_seconds: float = 30.0) -> WeightsClient:
        return WeightsClient(
            self.redis_url,
            self.root / "weights",
            namespace=self.keys.namespace,
            node_id=node_id,
            lease_seconds=lease_seconds,
        )


def split_per_rank(deployment: Deployment, version: int) -> int:
    """Register a copy of ``version`` with per-rank files, as ``--per-rank-files`` writes it:
    rank r's file holds, under the fused names, what ``rank_slice`` gives rank r."""
    client, keys = deployment.client, deployment.keys
    fields = client.hgetall(keys.version(version))
    source = deployment.root / "weights" / fields[b"path"].decode()  # relative or absolute
    manifest = Manifest.read(source)
    tensors = load_file(str(source / FUSED_WEIGHTS_FILE))
    target = source.parent / f"v{version}-per-rank"
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    entries, files = [], [file_entry(target / "config.json")]
    for rank in range(manifest.tp):
        name = fused_rank_file(rank, manifest.tp)
        parts = {}
        for entry in manifest.tensors:
            part = rank_slice(entry.shard, entry.shape, rank, manifest.tp)
            full = tensors[entry.name]
            parts[entry.name] = (
                full if part is None else full.narrow(part.dim, part.start, part.stop - part.start)
            ).contiguous()
            entries.append(
                dataclasses.replace(
                    entry, file=name, shape=list(parts[entry.name].shape), rank=rank
                )
            )
        save_file(parts, str(target / name))
        files.append(file_entry(target / name))
    text = (
        dataclasses.replace(manifest, files=files, tensors=entries, per_rank_files=True)
        .to_json()
        .encode()
    )
    (target / MANIFEST_NAME).write_bytes(text)
    copy = version + 100
    client.hset(
        keys.version(copy),
        mapping={**fields, b"path": target.name, b"manifest_sha256": sha256_bytes(text)},
    )
    client.zadd(keys.versions, {copy: copy})
    return copy


def push_batches(
    redis_url: str,
    keys: Keys,
    count: int,
    policy_version: int = 0,
    prefix: str = "b",
    seed: int = 0,
    vocab_size: int = 1024,
    skip: int = 0,
) -> dict[str, str]:
    """Push ``count`` valid batches, each with a unique ``meta.uid``; stream id -> uid.

    The batches are those after the first ``skip`` of the ``seed``'s sequence, so two calls
    can push one sequence in two parts."""
    producer = BatchProducer(redis_url, keys.namespace, name="test-producer", max_pending=0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(skip):
        synthetic_batch(generator, batch_size=2, seq_len=16, vocab_size=vocab_size)
    pushed = {}
    for index in range(skip, skip + count):
        uid = f"{prefix}{index}"
        tensors = synthetic_batch(generator, batch_size=2, seq_len=16, vocab_size=vocab_size)
        pushed[producer.push(tensors, policy_version, uid=uid)] = uid
    return pushed


def push_raw(client: redis.Redis, keys: Keys, tensors: dict[str, torch.Tensor], **meta: Any) -> str:
    """Add an entry as a careless producer would, without validating it first."""
    fields = {
        BATCH_FIELD: save(tensors),
        META_FIELD: json.dumps({"policy_version": 0, "producer": "careless", **meta}),
    }
    return client.xadd(keys.batches, fields).decode()


def heartbeat(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer_heartbeat).items()}


def pending(client: redis.Redis, keys: Keys) -> int:
    return client.xpending(keys.batches, TRAINER_GROUP)["pending"]


def dead_letters(client: redis.Redis, keys: Keys) -> dict[str, str]:
    """Dead-lettered entries: original stream id -> reason, oldest first."""
    return {
        fields[b"orig_id"].decode(): fields[b"reason"].decode()
        for _, fields in client.xrange(keys.dead_letters)
    }


def final_train_state(resume_dir: Path) -> TrainState:
    """The train state of the newest complete resume checkpoint."""
    found = newest_checkpoint(resume_dir)
    assert found is not None, f"no complete resume checkpoint in {resume_dir}"
    return read_train_state(found[1])


def checkpoint_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a resume checkpoint (no optimizer, schedule or train state)."""
    return read_model_weights(checkpoint)


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    """Poll ``condition`` until it returns something true; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(every)
    return result


def redis_ms(client: redis.Redis) -> int:
    """Redis's clock in milliseconds: what lease expiries are scored against."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def subscribers(client: redis.Redis, channel: str) -> int:
    """How many connections are subscribed to ``channel`` now."""
    return dict(client.pubsub_numsub(channel))[channel.encode()]


def torchrun(nproc: int, *args: str) -> list[str]:
    """argv of ``torchrun --standalone --nproc_per_node <nproc> <args>``.

    ``--standalone`` lets the rendezvous store bind port 0 and tell the workers the port the
    kernel gave it. A port picked beforehand with :func:`free_port` can be taken by another
    process before torchrun binds it (EADDRINUSE at start-up, seen with test suites running
    side by side).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*command, "--nproc_per_node", str(nproc), *args]


def run_torchrun_trainer(
    env: dict[str, str], nproc: int, *args: str
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node <nproc> -m weightcast_trainer <args>``."""
    command = torchrun(nproc, "-m", "weightcast_trainer", *args)
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


_SHARDED_SAVE = """
import dataclasses, json, sys
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pathlib import Path
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from weightcast_trainer.dcp_safetensors import SafetensorsStorageWriter

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
state = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in load_file(sys.argv[1]).items()}
if sys.argv[3] == "dcp-torchsave":
    dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[2]))
else:
    storage = SafetensorsStorageWriter(Path(sys.argv[2]))
    dcp.save(state, storage_writer=storage)
    if dist.get_rank() == 0:
        files = [dataclasses.asdict(f) for f in storage.files]
        (Path(sys.argv[2]) / "files.json").write_text(json.dumps(files))
dist.barrier()
dist.destroy_process_group()
"""


def write_sharded_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor],
    ranks: int,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """A snapshot written by ``ranks`` gloo processes, every tensor sharded along dim 0 (FSDP),
    in either format."""
    path = checkpoint_dir / snapshot_name(step)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    source = checkpoint_dir / f"state-{step}.safetensors"
    save_file(state, str(source))
    result = subprocess.run(
        torchrun(
            ranks,
            "--no-python",
            sys.executable,
            "-c",
            _SHARDED_SAVE,
            str(source),
            str(path),
            format,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    source.unlink()
    files: tuple[SnapshotFile, ...] = ()
    if format == FORMAT_DCP_SAFETENSORS:
        listing = path / "files.json"
        files = tuple(SnapshotFile(**f) for f in json.loads(listing.read_text()))
        listing.unlink()
    return finish_snapshot(path, step, shape, format, files)


def publish_snapshot(
    checkpoint_dir: Path,
    step: int,
    shape: ModelShape,
    state: dict[str, torch.Tensor] | None = None,
    format: str = FORMAT_DCP_SAFETENSORS,
) -> Path:
    """Write a snapshot aside and rename it into ``checkpoint_dir``, as the trainer does, so a
    running publisher never sees it half-written."""
    staging = checkpoint_dir.parent / f"staging-{uuid.uuid4().hex[:8]}"
    written = write_snapshot(staging, step, shape, state, format)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / written.name
    os.rename(written, final)
    staging.rmdir()
    return final


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``16k``, ``2m``) mounted at ``path`` for a test: a small
    filesystem that fills up. Needs root (or CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        raise AssertionError(f"this test mounts a tmpfs (run it as root): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def rank_part(tensor: torch.Tensor, shard: Shard, rank: int, tp: int) -> torch.Tensor:
    """What tp rank ``rank`` holds of a published ``tensor`` (``sharding.rank_slice``), a view."""
    part = rank_slice(shard, list(tensor.shape), rank, tp)
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)


def rank_byte_ranges(directory: Path, rank: int, tp: int) -> list[tuple[int, int]]:
    """The byte ranges of ``directory``'s model.vllm-fused that tp rank ``rank`` needs: the
    header and each tensor's part (its rows; a column block: every byte of the tensor, since
    each row holds some of the rank's columns), worked out from the file's header and the
    manifest's shard specs."""
    with open(directory / FUSED_WEIGHTS_FILE, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    ranges = [(0, 8 + length)]
    for entry in Manifest.read(directory).tensors:
        begin, end = (8 + length + o for o in header[entry.name]["data_offsets"])
        part = rank_slice(entry.shard, entry.shape, rank, tp)
        if part is not None and part.dim == 0:
            row = (end - begin) // entry.shape[0]
            begin, end = begin + part.start * row, begin + part.stop * row
        ranges.append((begin, end))
    return ranges


def copy_version(deployment: Deployment, version: int) -> tuple[int, Path]:
    """A copy of ``version``'s directory as ``v<N>`` under a fresh version number N, to be
    changed and then registered with :func:`register_version`."""
    number = deployment.registry.allocate_version()
    weights = deployment.root / "weights"
    source = weights / deployment.client.hget(deployment.keys.version(version), "path").decode()
    target = weights / f"v{number}"
    shutil.copytree(source, target, symlinks=True)
    return number, target


def register_version(
    deployment: Deployment,
    number: int,
    like: int,
    path: str | None = None,
    drop: tuple[str, ...] = (),
) -> None:
    """Register ``v<number>`` as the publisher would (version hash, live set, latest, event),
    its hash copied from version ``like`` but for ``path`` (``v<number>`` unless given), the
    SHA-256 of the directory's manifest as it is now, and the fields in ``drop`` left out."""
    client, keys = deployment.client, deployment.keys
    path = f"v{number}" if path is None else path
    fields = {k.decode(): v for k, v in client.hgetall(keys.version(like)).items()}
    manifest = deployment.root / "weights" / f"v{number}" / MANIFEST_NAME
    if manifest.is_file() and not manifest.is_symlink():
        fields["manifest_sha256"] = sha256_bytes(manifest.read_bytes())
    fields["path"] = path
    for name in drop:
        fields.pop(name, None)
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.version(number), mapping=fields)
    pipe.zadd(keys.versions, {number: number})
    pipe.set(keys.latest, number)
    pipe.publish(keys.events, json.dumps({"event": "published", "version": number}))
    pipe.execute()


def redigest(
    directory: Path, algorithm: str = DEFAULT_DIGEST, block_bytes: int = BLOCK_BYTES
) -> bytes:
    """Rewrite ``directory``'s manifest with the digests of each listed file as it is now (so
    a deliberately broken file passes them): format 2 with block digests, or format 1 with a
    whole-file SHA-256 when ``algorithm`` is ``sha256``. Returns the manifest's bytes."""
    manifest = Manifest.read(directory)
    if algorithm == "sha256":
        files = [
            FileEntry(
                f.name, (directory / f.name).stat().st_size, sha256=sha256_file(directory / f.name)
            )
            for f in manifest.files
        ]
        manifest_format = MANIFEST_FORMATS[0]
    else:
        files = [
            FileEntry(
                f.name,
                (directory / f.name).stat().st_size,
                blocks=file_digests(directory / f.name, algorithm, block_bytes),
            )
            for f in manifest.files
        ]
        manifest_format = MANIFEST_FORMAT
    text = dataclasses.replace(manifest, files=files, format=manifest_format).to_json().encode()
    (directory / MANIFEST_NAME).write_bytes(text)
    return text


class OpenWatch:
    """The kernel's word (inotify ``IN_OPEN`` / ``IN_ACCESS``) on whether any process opened
    or read a file directly in ``directory`` while the watch was on."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        mask = self.IN_ACCESS | self.IN_OPEN
        assert self._libc.inotify_add_watch(self.fd, str(directory).encode(), mask) >= 0

    def touched(self) -> list[str]:
        """Names opened or read since the watch began (or since the last call)."""
        names = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(data):
                _wd, _mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                names.append(data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode())
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


class OutputLines:
    """A process's output, read line by line by a thread, so that a test can wait for a
    line (an event) with a generous timeout instead of sleeping."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.lines: list[str] = []
        self._seen = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> str:
        """The next line (after the last one matched) that matches the regex ``pattern``."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for index in range(self._seen, len(self.lines)):
                    if compiled.search(self.lines[index]):
                        self._seen = index + 1
                        return self.lines[index]
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r}; output:\n{''.join(self.lines)}"
                self._changed.wait(left)

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)


def healthz(port: int) -> int:
    """The status code of ``/healthz`` on a local port (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class HfModel(NamedTuple):
    """A ``save_pretrained`` model: its shape and the rest of its ``config.json``."""

    shape: ModelShape
    extras: ConfigExtras


_TIED_ODD = ModelShape(
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=24,  # not hidden / heads (16)
    vocab_size=1000,  # not a multiple of 64
    tie_word_embeddings=True,
)
_UNTIED_ODD = ModelShape(
    num_layers=3,
    hidden_size=96,
    intermediate_size=200,
    num_heads=6,
    num_kv_heads=3,
    head_dim=32,  # not hidden / heads (16)
    vocab_size=1003,  # not a multiple of 64; the vLLM tests prompt ids up to 999
    tie_word_embeddings=False,
)
_TIED_EXTRAS = ConfigExtras(
    max_position_embeddings=300, rms_norm_eps=1e-5, rope_theta=12345.0, eos_token_id=7
)
_UNTIED_EXTRAS = ConfigExtras(
    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=500000.0, eos_token_id=(3, 4)
)
HF_SHAPES = {
    "tied-odd": HfModel(_TIED_ODD, _TIED_EXTRAS),
    "untied-odd": HfModel(_UNTIED_ODD, _UNTIED_EXTRAS),
    "moe-untied-odd": HfModel(
        dataclasses.replace(
            _UNTIED_ODD,
            hidden_size=48,
            intermediate_size=80,  # the dense layer's width
            num_heads=4,
            num_kv_heads=2,
            head_dim=24,
            num_experts=6,  # 3 per rank under 2-rank FSDP
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            mlp_only_layers=(1,),  # a dense layer between two sparse ones
            norm_topk_prob=True,
        ),
        _UNTIED_EXTRAS,
    ),
    "moe-tied-odd": HfModel(
        dataclasses.replace(
            _TIED_ODD,
            num_experts=5,  # splits over no number of FSDP ranks
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,
        ),
        _TIED_EXTRAS,
    ),
}
"""Dense Qwen3 and Qwen3-MoE (``moe-*``) shapes that no flavor has: tied and untied, odd
vocabularies, head_dims and expert widths, top-k renormalised and not, a dense layer among
sparse ones and none, their own
rope_theta, rms_norm_eps, max_position_embeddings and eos."""


def save_pretrained_qwen3(
    directory: Path,
    shape: str = "tied-odd",
    dtype: torch.dtype = torch.bfloat16,
    shard_kb: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
) -> Path:
    """A real ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for a ``moe-*`` shape) checkpoint
    written by ``transformers``' ``save_pretrained`` (sharded into files of at most
    ``shard_kb`` KB when given), as a user's would be. Its
    weights are random and then moved off the init's distribution (+0.5 on every norm, a
    seed-dependent offset elsewhere), so a run that ignored it could not pass for it. A
    ``scale`` above 1 multiplies the matrices, for a model whose predictions are peaked (a
    random init's are near uniform, where even a wrong load changes little)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_shape, extras = HF_SHAPES[shape]
    config = model_shape.to_hf_config("float32", extras)
    torch.manual_seed(seed)
    if model_shape.moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config))
    else:
        model = Qwen3ForCausalLM(Qwen3Config.from_dict(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5)
            else:
                param.mul_(scale).add_(0.01 * (seed + 1))
    model.to(dtype).save_pretrained(
        directory, **({"max_shard_size": f"{shard_kb}KB"} if shard_kb else {})
    )
    return directory


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (or of an hf-layout version)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
