"""``weightcast follow --vllm-url``: keep a ``vllm serve`` on the newest version.

:class:`ServerNode` leases each new version, swaps the server to it
(:func:`~weightcast.client.vllm.engine.swap`), reports the node in ``{wc}:nodes``, and keeps
the lease of the version served until the next one replaces it. A version the engine refuses
is reported and skipped; a server that restarted (its version is no longer the one set) is
initialised again and brought to the newest version.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from weightcast.client.engine import (
    EngineError,
    ServerUnavailable,
    VersionRefused,
    served_lease,
    served_version,
)
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.server import VllmServer
from weightcast.client.weights import VersionGone, WeightsClient
from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.stop import Stop

log = get_logger("vllm")


class ServerNode:
    """``weightcast follow --vllm-url``: keep a ``vllm serve`` on the newest version.

    ``init_info`` is what the server's workers need to find versions (Redis, namespace, their
    weights root, the node id their leases carry); it is sent again whenever the server
    restarted.
    """

    def __init__(
        self,
        server: VllmServer,
        client: WeightsClient,
        init_info: dict[str, Any],
        report_every: float,
    ) -> None:
        self.server = server
        self.client = client
        self.init_info = init_info
        self.report_every = report_every
        self.served = 0
        """The version the server runs (0: not a weightcast version, or not known yet)."""
        self.refused: set[int] = set()
        """Versions the engine refused: not tried again."""
        self.ready = False
        """The server was initialised and its version read since it last went away."""
        self.trouble = ""
        """Why the server is not ready (logged once per reason)."""
        self.error = ""
        self.reported_at = 0.0
        self.lease = contextlib.ExitStack()
        """The lease on the version served, held until a newer one is loaded."""

    def connect(self) -> bool:
        """Initialise the server after a start or restart and learn its version; False
        while it does not answer."""
        try:
            self._recover()
            self.server.init_weight_transfer_engine(self.init_info)
            self.served = served_version(self.server.weight_version())
        except EngineError as exc:  # down, restarting, or not taking updates (yet)
            self._lost(exc)
            return False
        self.ready, self.trouble = True, ""
        self._hold(self.served)
        log.info("vllm server ready", url=self.server.url, served=self.served)
        return True

    def _lost(self, error: EngineError) -> None:
        """The server does not answer as it should: wait, and initialise it again."""
        if str(error) != self.trouble:
            log.warning("vllm server unavailable; waiting for it", error=str(error))
            self.trouble = str(error)
        self.ready = False

    def _recover(self) -> None:
        """Undo what a node killed mid-update may have left: an open session, a pause."""
        try:
            self.server.finish_weight_update()
        except ServerUnavailable:
            raise
        except EngineError:
            pass  # no session was open: the usual case
        else:
            log.warning("closed a weight update that a previous node left open")
        self.server.resume()

    @property
    def current(self) -> int:
        """The version served (what ``/healthz`` and ``follow.until_version`` look at)."""
        return self.served

    def step(self, timeout: float, stop: Stop | None = None) -> None:
        """Check the server, load the newest version if it is newer, report the node; else
        wait up to ``timeout`` seconds for a newer one (``stop`` ends the wait early)."""
        if not self.ready and not self.connect():
            time.sleep(min(timeout, 1.0))
            return
        try:
            if served_version(self.server.weight_version()) != self.served:
                log.warning("vllm server restarted; initialising it again", url=self.server.url)
                if not self.connect():
                    return
        except EngineError as exc:
            self._lost(exc)
            return
        newest = self.client.latest()
        if newest > self.served and newest not in self.refused:
            self.load(newest)
        else:
            self.report()
            self.client.wait_for_newer(
                max(self.served, *self.refused, 0), timeout, timeout, stop=stop
            )

    def load(self, version: int) -> None:
        """Lease ``version``, swap the server to it, report it (or the error)."""
        started = time.perf_counter()
        lease = contextlib.ExitStack()
        try:
            lease.enter_context(self.client.lease(version))
            swap(self.server, version, self.init_info)
        except VersionGone:
            lease.close()
            log.info("version evicted before it could be leased", version=version)
            return
        except EngineError as exc:
            lease.close()
            if isinstance(exc, VersionRefused):  # the version's fault: not tried again
                self.refused.add(version)
            else:  # the server's: try again once it answers
                self._lost(exc)
            self.error = f"v{version} not loaded: {exc}"
            log.error("vllm did not load version", version=version, error=str(exc))
            self.report(force=True)
            return
        self.lease.close()
        self.lease = lease
        self.served, self.error = version, ""
        self.report(force=True)
        log.info(
            "vllm serves version",
            version=version,
            seconds=round(time.perf_counter() - started, 3),
        )

    def report(self, force: bool = False) -> None:
        """Record in ``{wc}:nodes`` the version served (and the last error, if any)."""
        if not force and time.monotonic() - self.reported_at < self.report_every:
            return
        if self.error or self.served:
            self.client.report_loaded(self.served, self.error)
        self.reported_at = time.monotonic()

    def _hold(self, version: int) -> None:
        """Lease the version the server runs (when it is a live one), releasing any other."""
        self.lease.close()
        self.lease = served_lease(self.client, version)

    def close(self) -> None:
        self.lease.close()


def server_node(config: Config, client: WeightsClient) -> ServerNode:
    """The :class:`ServerNode` ``weightcast follow --vllm-url`` runs (the CLI's loop rides out
    Redis outages around :meth:`ServerNode.step`)."""
    cfg = config.follow
    server = VllmServer(cfg.vllm_url, cfg.vllm_timeout_seconds, cfg.vllm_pause_mode)
    if cfg.vllm_weights_dir and config.common.weights_url:
        raise ConfigError(
            "follow.vllm_weights_dir has no effect with weights_url: the server's workers read "
            "the bucket; drop one of them"
        )
    if config.common.weights_url:
        weights_root = config.common.weights_location()
    else:
        weights_root = str(Path(cfg.vllm_weights_dir or config.common.weights_dir).absolute())
    init_info = {
        "redis_url": config.common.redis_url,
        "namespace": config.common.namespace,
        "weights_root": weights_root,
        "node_id": client.node_id,
    }
    return ServerNode(server, client, init_info, report_every=cfg.poll_seconds)
