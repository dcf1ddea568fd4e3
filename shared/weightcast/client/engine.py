"""What every inference engine's driver says when a weight update fails (vLLM's, SGLang's).

The engines differ in their update calls (:mod:`weightcast.client.vllm.engine`,
:mod:`weightcast.client.sglang.engine`); their failures are typed here once, so that a node
loop treats a refused version (not worth trying again), an engine failure and an engine that
does not answer the same way whatever the engine.
"""

from __future__ import annotations

from weightcast.contract.errors import WeightcastError

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
