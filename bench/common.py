"""What the benchmarks share: the machine line, timing and medians of ratios, the raw disk
baselines (cp + fsync, a write + fsync, a cold read), the page cache, the environment of a
weightcast process and the wait for its ``published`` event, the engine benchmarks' two
versions, and the ``--json`` file.

The scripts of ``bench/`` import it as ``common`` (``bench/`` is the first entry of
``sys.path`` when a script of it runs, as ``python -m bench NAME`` runs them).
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from weightcast.runtime.durable import fsync_path

REPO = Path(__file__).resolve().parent.parent


def machine_line() -> str:
    """``host, N CPUs, load L``: the line a benchmark prints before its figures."""
    return f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"


def save_json(path: Path | None, figures: Any) -> None:
    """Write ``figures`` to ``path`` (a ``--json`` argument), when one was given."""
    if path:
        path.write_text(json.dumps(figures, indent=1))


# Timing and ratios


def timed(call: Callable[[], object]) -> float:
    """The seconds ``call()`` took."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def med(rows: list[dict], key: str) -> float:
    """The median of ``row[key]`` over the rounds."""
    return statistics.median(r[key] for r in rows)


def ratio(rows: list[dict], top: str, bottom: str) -> tuple[float, float, float]:
    """Each round's ``top / bottom``: their median, min and max."""
    values = [r[top] / r[bottom] for r in rows]
    return statistics.median(values), min(values), max(values)


def spread(r: tuple[float, float, float]) -> str:
    """A :func:`ratio` as ``1.23x (1.01..1.40)``."""
    return f"{r[0]:.2f}x ({r[1]:.2f}..{r[2]:.2f})"


def alternate(round_: int, cases: dict[str, Callable[[], dict]]) -> dict:
    """Each case once, the order rotated by the round; what they return, merged, with the load
    average before the first."""
    names = list(cases)
    turn = round_ % len(names)
    row: dict = {"load": os.getloadavg()[0]}
    for name in names[turn:] + names[:turn]:
        row |= cases[name]()
    return row


# The disk: the baselines and the page cache


def settle() -> None:
    """Flush and wait, so that earlier deletes (discards) and writeback do not land in a timing."""
    os.sync()
    time.sleep(1.0)


def data_files(path: Path) -> list[Path]:
    """A snapshot's data files (safetensors or DCP), by name."""
    return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".distcp"))


def raw_copy(template: Path, target: Path) -> float:
    """Copy the template's data files with fsync: the cp + fsync baseline (the caller removes
    ``target``); the seconds."""
    start = time.perf_counter()
    target.mkdir()
    for src in data_files(template):
        dst = target / src.name
        shutil.copyfile(src, dst)
        fsync_path(dst)
    fsync_path(target)
    return time.perf_counter() - start


def raw_write(path: Path, chunks: Iterable[memoryview], flags: int = os.O_TRUNC) -> float:
    """Write the chunks into one new file at ``path`` (``os.O_CREAT | flags``) and fsync it: the
    write + fsync baseline; the seconds, the open and the close included."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        for data in chunks:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def cold_read(path: Path) -> float:
    """Drop the file's pages, then read it into fresh memory; the seconds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        start = time.perf_counter()
        buffer = mmap.mmap(-1, size)
        view, done = memoryview(buffer), 0
        while done < size:
            done += os.preadv(fd, [view[done:]], done)
        seconds = time.perf_counter() - start
        view.release()
        buffer.close()
        return seconds
    finally:
        os.close(fd)


def drop_pages(directory: Path, sync: bool = False) -> None:
    """Drop the page-cache pages of every file below ``directory`` (``posix_fadvise
    DONTNEED``: a cold cache without root); dirty pages stay unless ``sync`` writes them back
    first."""
    if sync:
        os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# Memory


def vm(field: str, pid: int | str = "self") -> int:
    """A ``/proc/PID/status`` figure (``VmHWM``, ``VmRSS``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_rss_mb(pid: int) -> float:
    """The process's peak RSS (``VmHWM``) in MiB; NaN when it has none (it has exited)."""
    try:
        return vm("VmHWM", pid) / 2**20
    except KeyError:
        return float("nan")


# weightcast processes


def weightcast_env(url: str, namespace: str, checkpoints: Path, weights: Path) -> dict[str, str]:
    """This process's environment and the settings of a weightcast process (trainer, publisher
    or node) of a benchmark: its Redis, namespace and folders."""
    return {
        **os.environ,
        "WEIGHTCAST_REDIS_URL": url,
        "WEIGHTCAST_NAMESPACE": namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(checkpoints),
        "WEIGHTCAST_WEIGHTS_DIR": str(weights),
    }


def next_event(events: Any, timeout: float, log: Callable[[], str]) -> dict:
    """The next event on ``events`` (a redis ``PubSub`` subscribed to the events channel), the
    subscription's own messages skipped; fails with the tail of ``log()`` when none comes in
    ``timeout`` seconds."""
    while True:
        message = events.get_message(timeout=timeout)
        assert message is not None, log()[-3000:]
        if message["type"] == "message":
            return json.loads(message["data"])


def wait_published(events: Any, timeout: float, log: Callable[[], str]) -> dict:
    """The next ``published`` event on ``events``, other events passed over."""
    while (event := next_event(events, timeout, log))["event"] != "published":
        pass
    return event


ENGINE_CONTEXT = {"tiny": 1024, "0.6B": 4096}
"""The shapes the engine benchmarks run (:data:`weightcast.contract.model_shape.SHAPES`) and
the context (``max_position_embeddings``) each engine gets."""


def engine_versions(
    name: str, work: Path, redis_url: str, layout: str
) -> tuple[dict[str, Any], Any, list[int]]:
    """Two random versions of shape ``name`` in ``layout``, written by the real publisher (the
    tests' registry, on ``PYTHONPATH``) and synced to disk: the config, the registry and their
    numbers."""
    from weightcast.contract.model_shape import SHAPES, ConfigExtras

    from helpers.registry import Registry, random_state

    extras = ConfigExtras(max_position_embeddings=ENGINE_CONTEXT[name])
    config = SHAPES[name].to_hf_config(extras=extras)
    registry = Registry(redis_url, f"bench-{name}", work / name)
    versions = [
        registry.publish(config, random_state(config, seed), layout=layout) for seed in (1, 2)
    ]
    os.sync()
    return config, registry, versions
