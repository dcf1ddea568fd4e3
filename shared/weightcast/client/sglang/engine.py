"""The weight update of an SGLang engine, and the node that keeps an engine on the newest
version.

:func:`swap` is SGLang's own sequence: pause (in the node's pause mode), open a weight-update
session, hand over the staged tensors, close the session (SGLang post-processes the weights
there), set the version SGLang reports, continue. :class:`SglangEngine` is what it needs of an
engine: an ``sglang.Engine`` in this process (:mod:`.local_engine`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import torch
import xxhash

from weightcast.client.engine import EngineError, served_lease
from weightcast.client.settings import SGLANG_PAUSE_MODES
from weightcast.client.sglang.staging import StagedVersion, stage
from weightcast.client.weights import WeightsClient
from weightcast.contract.model_shape import ModelShape
from weightcast.runtime.logs import get_logger

log = get_logger("sglang")

PAUSE_MODES = SGLANG_PAUSE_MODES
"""``wait``: no pause; SGLang runs the update between two scheduler steps and flushes the
cache computed with the old weights (it refuses while requests run). The others are SGLang's
``pause_generation`` modes: ``abort`` ends running requests, ``retract`` puts them back in the
queue (recomputed with the new weights), ``in_place`` keeps them and their old KV cache."""


class SglangEngine(Protocol):
    """The update calls :func:`swap` makes, as SGLang names them."""

    def pause(self) -> None: ...

    def begin_weight_update(self) -> None: ...

    def update_weights_from_tensor(self, tensors: list[tuple[str, torch.Tensor]]) -> None: ...

    def end_weight_update(self) -> None: ...

    def update_weight_version(self, version: str) -> None: ...

    def weight_version(self) -> str: ...

    def resume(self) -> None: ...


def swap(engine: SglangEngine, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load ``tensors`` (all of ``version``'s, or those that differ from what the engine holds)
    into the engine and make it report ``version``; raises :class:`EngineError` (the session
    is closed and generation continues either way)."""
    engine.pause()
    try:
        engine.begin_weight_update()
        try:
            if tensors:
                engine.update_weights_from_tensor(tensors)
        finally:
            engine.end_weight_update()
        engine.update_weight_version(str(version))
    finally:
        engine.resume()


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """xxh3-128 of a tensor's bytes: what tells a changed tensor from one the engine holds."""
    return xxhash.xxh3_128_digest(tensor.contiguous().view(torch.uint8).numpy())


class SglangNode:
    """Keeps an SGLang engine on the versions it is asked to load.

    Holds the lease of the version served until a newer one replaces it, reports each load
    (or refusal) in ``{wc}:nodes``, and keeps its client's host base, so that the next version
    is read by delta when it can be. SGLang's update takes any subset of the tensors, so only
    those whose bytes differ from what the engine holds are handed over (the first load, and
    any after a failed one, hands every tensor).
    """

    def __init__(self, engine: SglangEngine, client: WeightsClient, shape: ModelShape) -> None:
        self.engine = engine
        self.client = client
        self.shape = shape
        self.served = 0
        """The version the engine runs (0: none of weightcast's yet)."""
        self.error = ""
        """Why the last version offered was not loaded ('' once one loads)."""
        self.via, self.read_bytes = "", 0
        """How the version served was read (``full``, ``delta``, ``chain``), and how much."""
        self.held: dict[str, bytes] = {}
        """The digest of each tensor the engine holds from the version served."""
        self.handed: list[str] = []
        """The tensors the last load handed to the engine."""
        self.lease = contextlib.ExitStack()

    def load(self, version: int) -> StagedVersion:
        """Lease, stage and swap ``version``. Raises :class:`VersionRefused` (nothing reached
        the engine), :class:`EngineError` (the engine failed), or
        :class:`~weightcast.contract.errors.VersionGone`; the node then serves what it
        served."""
        started = time.perf_counter()
        lease = contextlib.ExitStack()
        try:
            info = lease.enter_context(self.client.lease(version))
            staged = stage(self.client, info, self.shape)
            digests = {name: tensor_digest(t) for name, t in staged.tensors.items()}
            changed = [
                (name, tensor)
                for name, tensor in staged.tensors.items()
                if self.held.get(name) != digests[name]
            ]
            try:
                swap(self.engine, version, changed)
            except EngineError:
                self.held = {}  # SGLang may have loaded some of them: hand all next time
                raise
        except EngineError as exc:
            lease.close()
            self.error = f"v{version} not loaded: {exc}"
            self.report()
            log.error("sglang did not load version", version=version, error=str(exc))
            raise
        except BaseException:
            lease.close()
            raise
        self.lease.close()
        self.lease = lease
        self.served, self.error = version, ""
        self.via, self.read_bytes = staged.via, staged.read_bytes
        self.held, self.handed = digests, [name for name, _ in changed]
        self.report()
        log.info(
            "sglang serves version",
            version=version,
            via=staged.via,
            tensors=f"{len(changed)} of {len(staged.tensors)}",
            read_seconds=round(staged.read_seconds, 3),
            seconds=round(time.perf_counter() - started, 3),
        )
        return staged

    def hold(self, version: int) -> None:
        """Take ``version`` as the one the engine serves (a node that found its engine already
        on it) and lease it, when it is still live."""
        self.lease.close()
        self.lease = served_lease(self.client, version)
        self.served = version

    def report(self) -> None:
        """Record in ``{wc}:nodes`` the version served and the last error, if any."""
        if self.served or self.error:
            self.client.report_loaded(self.served, self.error, self.via, self.read_bytes)

    def close(self) -> None:
        """Release the lease of the version served."""
        self.lease.close()
