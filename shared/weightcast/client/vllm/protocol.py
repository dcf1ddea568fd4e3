"""What the ``weightcast`` backend takes through vLLM's weight-sync API: small JSON objects.

``init_weight_transfer_engine({"init_info": {...}})`` sets a node's defaults
(:class:`InitInfo`); each ``update_weights({"update_info": {...}})`` names one whole version
(:class:`UpdateInfo`) and may override those defaults. Whatever neither gives comes from
weightcast's own settings in the worker's environment (``WEIGHTCAST_REDIS_URL``,
``WEIGHTCAST_NAMESPACE``, ``WEIGHTCAST_WEIGHTS_DIR``, ``WEIGHTCAST_FOLLOW_NODE_ID``), so a
node can also be configured without an init call.

vLLM builds these with ``cls(**payload)``: an unknown key is refused with vLLM's
``Invalid update_info`` error, a bad value with the reason from ``__post_init__``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from weightcast.client.identity import default_node_id
from weightcast.runtime.config import Config

LOAD_MODES = ("auto", "inplace", "layerwise")
"""``inplace``: copy each rank part into the live parameter (the engine must keep
checkpoint-format parameters); ``layerwise``: vLLM's layerwise reload (any platform or
quantization); ``auto``: in place on CUDA without quantization when every parameter still has
its checkpoint shape and dtype, else layerwise."""


@dataclass
class Location:
    """Where a version is found: the registry (Redis, namespace) and this node's weights root
    (where the node sees the publisher's weights directory). ``node_id`` names the leases:
    each tensor-parallel rank leases as ``<node_id>-tp<rank>``. ``verified_dir``: the
    node-local directory where the engine's workers record the blocks they verified, so each
    block is verified once per node and version (:func:`default_verified_dir` if not given)."""

    redis_url: str | None = None
    namespace: str | None = None
    weights_root: str | None = None
    node_id: str | None = None
    verified_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("redis_url", "namespace", "weights_root", "node_id", "verified_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name!r} must be a string, got {value!r}")


@dataclass
class InitInfo(Location):
    """``init_info``: defaults for every later update of this engine."""

    load_mode: str = "auto"
    keep_base: bool = True
    """Keep a host copy of this rank's verified blocks, so that the next version whose delta
    is from the version loaded is read by delta (as much host memory as the rank's part)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"'load_mode' must be one of {LOAD_MODES}, got {self.load_mode!r}")
        if not isinstance(self.keep_base, bool):
            raise ValueError(f"'keep_base' must be true or false, got {self.keep_base!r}")


@dataclass(kw_only=True)
class UpdateInfo(Location):
    """``update_info``: one whole version, by number."""

    version: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"'version' must be an integer >= 1, got {self.version!r}")
        if self.version < 1:
            raise ValueError(f"'version' must be an integer >= 1, got {self.version!r}")


@dataclass(frozen=True)
class ResolvedLocation:
    """A :class:`Location` with every field decided."""

    redis_url: str
    namespace: str
    weights_root: str
    """A weights directory, or an ``s3://`` URL with its options."""
    node_id: str
    verified_dir: Path


def default_verified_dir() -> Path:
    """A directory of this user's on local disk, shared by every worker on the machine (the
    records are keyed by version and manifest digest, so engines of several namespaces can
    share it)."""
    return Path(tempfile.gettempdir()) / f"weightcast-{os.getuid()}-verified"


def resolve(update: UpdateInfo, init: InitInfo, config: Config) -> ResolvedLocation:
    """The update's own fields, else the init info's, else weightcast's settings."""

    def pick(name: str, fallback: str) -> str:
        for given in (getattr(update, name), getattr(init, name)):
            if given:
                return given
        return fallback

    return ResolvedLocation(
        redis_url=pick("redis_url", config.common.redis_url),
        namespace=pick("namespace", config.common.namespace),
        weights_root=pick("weights_root", config.common.weights_location()),
        node_id=pick("node_id", config.follow.node_id or default_node_id()),
        verified_dir=Path(pick("verified_dir", str(default_verified_dir()))),
    )
