"""An inference node's bookkeeping: load each new version once, then report it.

:class:`Node` leases a version, verifies and reads it through a
:class:`~weightcast.client.weights.WeightsClient`, records itself in ``{wc}:nodes`` and
releases the lease. What the node does with the tensors (a transformers model, a vLLM engine)
is the caller's business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from weightcast.client.weights import VersionGone, VersionInfo, WeightsClient, WeightsError
from weightcast.runtime.logs import get_logger

log = get_logger("node")


@dataclass(frozen=True)
class LoadedVersion:
    """A verified version in memory: its registry entry, every tensor and ``config.json``."""

    info: VersionInfo
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def version(self) -> int:
        return self.info.version


class Node:
    """Loads each new version once: lease, verify, read, report."""

    def __init__(self, client: WeightsClient, report_every: float) -> None:
        self.client = client
        self.report_every = report_every
        self.current = 0
        """The version this node serves (0: none yet)."""
        self.seen = 0
        """The newest version tried, loaded or refused: no need to try it again."""
        self.reported_at = 0.0

    def report(self) -> None:
        """Re-report the version served, so ``weightcast status`` sees the node is alive."""
        if self.current and time.monotonic() - self.reported_at >= self.report_every:
            self.client.report_loaded(self.current)
            self.reported_at = time.monotonic()

    def load(self, version: int) -> LoadedVersion | None:
        """Load ``version`` and report it; None when it was evicted first or is refused."""
        start = time.perf_counter()
        try:
            with self.client.lease(version) as info:
                loaded = LoadedVersion(info, self.client.load(info), self.client.config(info))
        except VersionGone:
            log.info(
                "version evicted before it could be leased; trying the latest", version=version
            )
            return None
        except WeightsError as exc:
            log.error("refusing version", version=version, reason=str(exc))
            self.seen = version
            return None
        self.client.report_loaded(version)
        self.current = self.seen = version
        self.reported_at = time.monotonic()
        log.info(
            "loaded version",
            version=version,
            step=info.step,
            tensors=len(loaded.tensors),
            bytes=info.bytes,
            seconds=round(time.perf_counter() - start, 3),
        )
        return loaded
