"""``weightcast follow --sglang-url``: keep an SGLang server on the newest version.

The node runs on the server's host (see :mod:`.server`): each newer version is leased, staged
(verified) and swapped in by an :class:`~weightcast.client.sglang.engine.SglangNode` whose
engine is the server; a version refused is reported and not tried again; a server that does
not answer is waited for; what a node stopped mid-update left open (SGLang's weight-update
session, a pause) is ended before the next load, which then hands every tensor. The engine's
model is read from the ``config.json`` of the directory the server was started from
(``/model_info``'s ``model_path``, on this host).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from weightcast.client.engine import EngineError, VersionRefused, served_version
from weightcast.client.sglang.engine import SglangNode
from weightcast.client.sglang.server import SglangServer
from weightcast.client.weights import VersionGone, WeightsClient
from weightcast.contract.errors import ConfigError
from weightcast.contract.model_shape import ModelShape
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.stop import Stop

log = get_logger("sglang")


class SglangServerNode:
    """``weightcast follow --sglang-url``: an :class:`SglangNode` driven by a loop."""

    def __init__(self, server: SglangServer, client: WeightsClient, report_every: float) -> None:
        self.server = server
        self.client = client
        self.report_every = report_every
        self.node: SglangNode | None = None
        """Built once the server answered (its model is then known)."""
        self.refused: set[int] = set()
        self.trouble = ""
        self.reported_at = 0.0

    @property
    def current(self) -> int:
        """The version served (what ``/healthz`` and ``follow.until_version`` look at)."""
        return self.node.served if self.node else 0

    def connect(self) -> bool:
        """Learn the server's model and version; False while it does not answer."""
        try:
            info = self.server.model_info()
        except EngineError as exc:
            if str(exc) != self.trouble:
                log.warning("sglang server unavailable; waiting for it", error=str(exc))
                self.trouble = str(exc)
            return False
        try:
            config = json.loads((Path(info["model_path"]) / "config.json").read_text())
        except OSError as exc:
            raise ConfigError(
                f"--sglang-url: cannot read the served model's config.json ({exc}); the node "
                "must run on the SGLang server's host"
            ) from None
        served = served_version(str(info["weight_version"]))
        if self.server.end_leftover_update():
            log.warning(
                "sglang server: ended the weight-update session a stopped node left open; "
                "loading the newest version whole",
                weight_version=info["weight_version"],
            )
            served = 0  # its weights may be partly another version's
        self.node = SglangNode(self.server, self.client, ModelShape.from_hf_config(config))
        self.node.hold(served)
        self.trouble = ""
        log.info("sglang server ready", url=self.server.url, served=self.node.served)
        return True

    def step(self, timeout: float, stop: Stop | None = None) -> None:
        """Load the newest version if it is newer than the one served; else report the node
        and wait up to ``timeout`` seconds for a newer one."""
        if self.node is not None and not self._same_server(self.node):
            self.node.close()
            self.node = None
        if self.node is None and not self.connect():
            time.sleep(min(timeout, 1.0))
            return
        assert self.node is not None
        newest = self.client.latest()
        if newest > self.node.served and newest not in self.refused:
            try:
                self.node.load(newest)
            except VersionRefused:
                self.refused.add(newest)
            except VersionGone:
                log.info("version evicted before it could be leased", version=newest)
            except EngineError:  # the server's: connect again, then try again
                self.node.close()
                self.node = None
            return
        if time.monotonic() - self.reported_at >= self.report_every:
            self.node.report()
            self.reported_at = time.monotonic()
        self.client.wait_for_newer(
            max(self.node.served, *self.refused, 0), timeout, timeout, stop=stop
        )

    def _same_server(self, node: SglangNode) -> bool:
        """Whether the server still reports the version this node set (a restarted server
        reports its start's; one that does not answer is connected again too)."""
        try:
            label = self.server.weight_version()
        except EngineError:
            return False
        if served_version(label) == node.served:
            return True
        log.warning("sglang server restarted; connecting again", url=self.server.url)
        return False

    def close(self) -> None:
        if self.node is not None:
            self.node.close()


def sglang_server_node(config: Config, client: WeightsClient) -> SglangServerNode:
    """The node ``weightcast follow --sglang-url`` runs."""
    cfg = config.follow
    server = SglangServer(cfg.sglang_url, cfg.sglang_timeout_seconds, cfg.sglang_pause_mode)
    return SglangServerNode(server, client, report_every=cfg.poll_seconds)
