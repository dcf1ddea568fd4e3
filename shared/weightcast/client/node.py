"""An inference node's bookkeeping: load each new version once, then report it.

:class:`Node` leases a version, verifies and reads it through a
:class:`~weightcast.client.weights.WeightsClient` and releases the lease; :meth:`Node.report`
records in ``{wc}:nodes`` the version it serves. A version that must not be loaded (any
:class:`WeightsError`: a bad path, manifest, config, header or digest) is logged and skipped;
Redis errors are left to the caller, which retries (the version is then tried again); an
object store that stays unavailable (:class:`StoreUnavailable`) leaves the node on the version
it holds, and the version is tried again at the next step; so does a version whose objects are
not in the store (:class:`ObjectMissing`: a deployment just moved to a new bucket, whose
publisher uploads the live versions it holds), tried again every :data:`MISSING_RETRY_S`. What
the node does with the tensors (a transformers model, a vLLM engine) is the caller's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import ObjectMissing, StoreUnavailable, VersionGone, WeightsError
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.logs import get_logger
from weightcast.runtime.stop import Stop

log = get_logger("node")

MISSING_RETRY_S = 5.0
"""How long a node waits before it tries again a version whose objects are not in the store."""


@dataclass(frozen=True)
class LoadedVersion:
    """A verified version in memory: its registry entry, every tensor and ``config.json``."""

    info: VersionInfo
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def version(self) -> int:
        return self.info.version


class Follower(Protocol):
    """What ``weightcast follow`` drives, whichever kind of node it runs (:class:`Node`,
    :class:`~weightcast.client.vllm.server_node.ServerNode` for ``--vllm-url``, or
    :class:`~weightcast.client.sglang.server_node.SglangServerNode` for ``--sglang-url``)."""

    client: WeightsClient

    @property
    def current(self) -> int:
        """The version served (0: none yet)."""
        ...

    def step(self, poll: float, stop: Stop | None = None) -> None:
        """Report when due, then wait up to ``poll`` seconds for a newer version and load it."""
        ...

    def close(self) -> None:
        """Release what the node holds between steps."""
        ...


class Node:
    """Loads each new version once: lease, verify, read, report."""

    def __init__(self, client: WeightsClient, report_every: float) -> None:
        self.client = client
        self.report_every = report_every
        self.current = 0
        """The version this node serves (0: none yet)."""
        self.seen = 0
        """The newest version tried, loaded or refused: no need to try it again."""
        self.reported_at: float | None = None
        """When the version served was last reported (None: not yet)."""
        self.via = ""
        """How the version served was read (``delta``, ``chain`` or ``full``)."""
        self.read_bytes = 0
        """The bytes read to load it."""
        self.missing = (0, 0.0)
        """A version found missing from the store, and when to try it again."""

    def report(self) -> None:
        """Report the version served when due (at once after a load, then every
        ``report_every`` seconds, so ``weightcast status`` sees the node is alive)."""
        due = self.reported_at is None or time.monotonic() - self.reported_at >= self.report_every
        if self.current and due:
            self.client.report_loaded(self.current, via=self.via, read_bytes=self.read_bytes)
            self.reported_at = time.monotonic()

    def step(self, poll: float, stop: Stop | None = None) -> None:
        """Report when due, wait up to ``poll`` seconds for a newer version (``stop`` ends
        the wait early), load it if there is one."""
        self.report()
        version = self.client.wait_for_newer(self.seen, timeout=poll, poll=poll, stop=stop)
        if version is None:
            return
        self.load(version)
        self.report()
        missing, retry_at = self.missing
        if version == missing:  # registered but not in the store (yet): wait, then again
            pause = max(0.0, min(poll, retry_at - time.monotonic()))
            if stop is None:
                time.sleep(pause)
            else:
                stop.wait(pause)

    def close(self) -> None:
        """Nothing to release: a lease is held only while a version loads."""

    def load(self, version: int) -> LoadedVersion | None:
        """Load ``version`` (call :meth:`report` next); None when it was evicted first or is
        refused or not in the store (yet)."""
        missing, retry_at = self.missing
        if version == missing and time.monotonic() < retry_at:
            return None
        start = time.perf_counter()
        try:
            with self.client.lease(version) as info:
                config = self.client.config(info)  # first: a refusal leaves the base as held
                loaded = LoadedVersion(info, self.client.load(info), config)
        except VersionGone:
            log.info(
                "version evicted before it could be leased; trying the latest", version=version
            )
            return None
        except ObjectMissing as exc:
            if version != missing:
                log.warning(
                    "version not in the store (yet); serving the version held, trying again",
                    version=version,
                    held=self.current,
                    retry_in=MISSING_RETRY_S,
                    reason=str(exc),
                )
            self.missing = (version, time.monotonic() + MISSING_RETRY_S)
            return None
        except WeightsError as exc:
            log.error("refusing version", version=version, reason=str(exc))
            self.seen = version
            return None
        except StoreUnavailable as exc:
            log.warning(
                "the object store is unavailable; serving the version held, trying again",
                version=version,
                held=self.current,
                reason=str(exc),
            )
            return None
        self.current = self.seen = version
        self.reported_at = None
        stats = self.client.reader.stats
        self.via, self.read_bytes = stats.via, stats.bytes_read
        log.info(
            "loaded version",
            version=version,
            step=info.step,
            tensors=len(loaded.tensors),
            bytes=info.bytes,
            via=stats.via,
            links=stats.links,
            read_bytes=stats.bytes_read,
            full_because=stats.reason or None,
            seconds=round(time.perf_counter() - start, 3),
        )
        return loaded
