"""Bring a vLLM engine to a new version, and keep a ``vllm serve`` on the newest one.

:func:`swap` is the update sequence for any engine run with the ``weightcast`` backend:
pause, start, update, finish, set the version vLLM reports, resume. If a step fails the
backend has touched nothing (or says it has), the session is closed on every rank (see
:mod:`.backend` on vLLM's executor) and the engine resumes on its old version. It runs over
:class:`VllmServer` (``vllm serve``'s HTTP routes, which exist with
``VLLM_SERVER_DEV_MODE=1``) and :class:`LocalEngine` (a ``vllm.LLM`` in this process).

:class:`ServerNode` is ``weightcast follow --vllm-url``: it leases each new version, swaps the
server to it, reports the node in ``{wc}:nodes``, and keeps the lease of the version served
until the next one replaces it. A version the engine refuses is reported and skipped; a
server that restarted (its version is no longer the one set) is initialised again and
brought to the newest version. vLLM itself is not imported here.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from weightcast.client.vllm.protocol import REFUSED
from weightcast.client.weights import VersionGone, WeightsClient
from weightcast.contract.errors import WeightcastError
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger

log = get_logger("vllm")


class EngineError(WeightcastError):
    """A step of a weight update failed; the engine was resumed on the version it had."""


class VersionRefused(EngineError):
    """The backend refused the version itself (it does not fit the engine) and touched no
    parameter: not worth trying again, unlike the engine's own failures."""


class ServerUnavailable(EngineError):
    """The vLLM server did not answer (down, restarting, or not started yet)."""


class Engine(Protocol):
    """The weight-sync calls :func:`swap` makes, as vLLM names them."""

    def pause(self) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self) -> None: ...

    def update_weight_version(self, version: str) -> None: ...

    def resume(self) -> None: ...


def swap(engine: Engine, version: int, where: dict[str, Any] | None = None) -> None:
    """Load ``version`` and make the engine report it; raises :class:`EngineError` (the
    engine then serves its old version; nothing was changed if the backend refused).

    ``where`` (``redis_url``, ``namespace``, ``weights_root``, ``node_id``) goes with the
    update, for engines that may have lost their ``init_info`` (a restarted server).
    """
    engine.pause()
    try:
        engine.start_weight_update()
        engine.update_weights({"version": version, **(where or {})})
        engine.finish_weight_update()
        engine.update_weight_version(str(version))
    except EngineError:
        # Ranks that returned from a failed update still hold their session (only the last
        # rank raises); finishing closes them. The last rank's is closed already: it answers
        # with an error, which changes nothing.
        with contextlib.suppress(EngineError):
            engine.finish_weight_update()
        raise
    finally:
        engine.resume()


class VllmServer:
    """``vllm serve``'s weight-sync routes (``VLLM_SERVER_DEV_MODE=1``) over HTTP."""

    def __init__(self, url: str, timeout: float, pause_mode: str = "wait") -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.pause_mode = pause_mode

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One request; the JSON reply. Raises :class:`EngineError` with vLLM's message for
        an error status, :class:`ServerUnavailable` when nothing answers."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + route, data, {"Content-Type": "application/json"}, method=method
        )
        log.debug("vllm request", route=route)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise engine_error(f"{method} {route}: HTTP {exc.code}: {_message(exc)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnavailable(f"{method} {route}: {self.url} unreachable: {reason}") from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def weight_version(self) -> str:
        return str(self.call("GET", "/weight_info")["weight_version"])

    def pause(self) -> None:
        """``wait`` lets running requests finish (``abort`` ends them); either way the KV and
        prefix caches, computed with the old weights, are cleared."""
        self.call("POST", f"/pause?mode={self.pause_mode}")

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.call("POST", "/finish_weight_update")

    def update_weight_version(self, version: str) -> None:
        self.call("POST", "/update_weight_version", {"new_version": version})

    def resume(self) -> None:
        self.call("POST", "/resume")


class LocalEngine:
    """A ``vllm.LLM`` in this process, run with ``WeightTransferConfig(backend="weightcast")``.

    ``LLM`` calls block until done, so there is nothing in flight to pause; the prefix cache
    (KV computed with the old weights) is reset on resume.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _run(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.llm, name)(*args)
        except Exception as exc:  # vLLM reports a worker's failure as a bare Exception
            raise engine_error(f"{name}: {exc}") from exc

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run("init_weight_transfer_engine", {"init_info": init_info})

    def weight_version(self) -> str:
        return str(self._run("get_weight_version"))

    def pause(self) -> None:
        """Nothing runs between two ``LLM`` calls."""

    def start_weight_update(self) -> None:
        self._run("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run("update_weights", {"update_info": update_info})

    def finish_weight_update(self) -> None:
        self._run("finish_weight_update")

    def update_weight_version(self, version: str) -> None:
        self._run("update_weight_version", version)

    def resume(self) -> None:
        self._run("reset_prefix_cache")


ENGINE_REPLIES: dict[str, type[EngineError]] = {REFUSED: VersionRefused}
"""What the backend writes into its error -> the error's type. vLLM passes a worker's error
on as text only (an HTTP body, a bare ``Exception``); this is the one place that reads it."""


def engine_error(message: str) -> EngineError:
    """The error of a failed engine call, typed by :data:`ENGINE_REPLIES`."""
    kinds = [kind for mark, kind in ENGINE_REPLIES.items() if mark in message]
    return (kinds[0] if kinds else EngineError)(message)


def served_version(label: str) -> int:
    """The weightcast version behind vLLM's weight version label (0: not one of ours)."""
    return int(label) if label.isdigit() else 0


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

    def step(self, timeout: float, stop: threading.Event | None = None) -> None:
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
        self.lease = contextlib.ExitStack()
        if version:
            with contextlib.suppress(VersionGone):
                self.lease.enter_context(self.client.lease(version))

    def close(self) -> None:
        self.lease.close()


def server_node(config: Config, client: WeightsClient) -> ServerNode:
    """The :class:`ServerNode` ``weightcast follow --vllm-url`` runs (the CLI's loop rides out
    Redis outages around :meth:`ServerNode.step`)."""
    cfg = config.follow
    server = VllmServer(cfg.vllm_url, cfg.vllm_timeout_seconds, cfg.vllm_pause_mode)
    weights_root = cfg.vllm_weights_dir or str(config.common.weights_dir)
    init_info = {
        "redis_url": config.common.redis_url,
        "namespace": config.common.namespace,
        "weights_root": str(Path(weights_root).absolute()),
        "node_id": client.node_id,
    }
    return ServerNode(server, client, init_info, report_every=cfg.poll_seconds)


def _message(error: urllib.error.HTTPError) -> str:
    """vLLM's error message out of an error reply (``{"error": {"message": ...}}``)."""
    text = error.read().decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    detail = body.get("error", body) if isinstance(body, dict) else body
    return str(detail.get("message", detail) if isinstance(detail, dict) else detail)
