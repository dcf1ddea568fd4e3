"""The ``vllm.general_plugins`` entry point: registers the ``weightcast`` backend with vLLM.

``pyproject.toml`` declares it, so installing weightcast next to vLLM is enough for
``--weight-transfer-config '{"backend": "weightcast"}'`` (``vllm serve``) and
``WeightTransferConfig(backend="weightcast")`` (``LLM``). vLLM runs general plugins in every
process it starts (front end, engine core, each worker), possibly more than once, and its
factory refuses a name registered twice, so :func:`register` checks first. It registers the
backend by module path: the backend module, which imports vLLM's model code, is only imported
in the workers that create an engine.
"""

from __future__ import annotations

BACKEND = "weightcast"


def register() -> None:
    """Register the ``weightcast`` weight-transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "weightcast.client.vllm.backend", "WeightcastWeightTransferEngine"
        )
