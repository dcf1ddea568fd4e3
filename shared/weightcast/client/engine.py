"""What every inference engine's driver says when a weight update fails (vLLM's, SGLang's),
and what its node keeps of the version the engine serves.

The engines differ in their update calls (:mod:`weightcast.client.vllm.engine`,
:mod:`weightcast.client.sglang.engine`); their failures are typed here once, so that a node
loop treats a refused version (not worth trying again), an engine failure and an engine that
does not answer the same way whatever the engine. Either engine reports the version it serves
as a label (:func:`served_version`), and its node leases that version (:func:`served_lease`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from weightcast.client.versions import VersionGone
from weightcast.contract.errors import LayoutError, WeightcastError, WeightsError
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.version_info import VersionInfo

if TYPE_CHECKING:
    from weightcast.client.weights import WeightsClient

REFUSED = "refused, no parameter touched"
"""In the error of an update that was refused: the version does not fit the engine, which
still serves what it served (any other error is the engine's, not the version's)."""


class EngineError(WeightcastError):
    """A step of a weight update failed; the engine was resumed on the version it had."""


class VersionRefused(EngineError):
    """The version itself was refused (it does not fit the engine) and no parameter was
    touched: not worth trying again, unlike the engine's own failures."""


class ServerUnavailable(EngineError):
    """The engine's server did not answer (down, restarting, or not started yet)."""


def check_engine_model(config: dict[str, Any], info: VersionInfo, engine_shape: ModelShape) -> None:
    """Refuse (a WeightsError) a version whose ``config.json`` (``config``, read and verified
    by the caller) is not the engine's model: an engine can load weights only of the shape it
    was built for."""
    try:
        shape = ModelShape.from_hf_config(config)
    except LayoutError as exc:
        raise WeightsError(f"version {info.version}: {exc}") from None
    if shape != engine_shape:
        raise WeightsError(
            f"version {info.version} is a different model ({shape}) from the engine's "
            f"({engine_shape})"
        )


def served_version(label: str) -> int:
    """The weightcast version behind an engine's weight version label (0: not one of ours)."""
    return int(label) if label.isdigit() else 0


def served_lease(client: WeightsClient, version: int) -> contextlib.ExitStack:
    """A lease on ``version``, the one an engine serves, while it is live (else none): what a
    node holds until it replaces that version."""
    lease = contextlib.ExitStack()
    if version:
        with contextlib.suppress(VersionGone):
            lease.enter_context(client.lease(version))
    return lease
