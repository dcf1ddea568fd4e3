"""weightcast: move fresh policy weights from an RL trainer to a fleet of inference nodes.

The public API for the people around the pipeline::

    from weightcast import BatchProducer, WeightsClient

Names are imported on first use, so ``import weightcast.contract.keys`` (or the
``weightcast status`` command) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "WeightsClient": "weightcast.client.weights",
    "AsyncWeightsClient": "weightcast.client.weights",
    "VersionInfo": "weightcast.contract.version_info",
    "VersionGone": "weightcast.contract.errors",
    "WeightsError": "weightcast.contract.errors",
    "BatchProducer": "weightcast.client.producer",
    "AsyncBatchProducer": "weightcast.client.producer",
    "BackPressureTimeout": "weightcast.client.producer",
    "BatchLimits": "weightcast.contract.codec",
    "InvalidBatch": "weightcast.contract.errors",
    "RolloutBatch": "weightcast.contract.codec",
    "Keys": "weightcast.contract.keys",
    "LayoutError": "weightcast.contract.errors",
    "Manifest": "weightcast.contract.manifest",
    "WeightcastError": "weightcast.contract.errors",
    "ConfigError": "weightcast.contract.errors",
    "RedisUnavailable": "weightcast.contract.errors",
}

__all__ = [
    "AsyncBatchProducer",
    "AsyncWeightsClient",
    "BackPressureTimeout",
    "BatchLimits",
    "BatchProducer",
    "ConfigError",
    "InvalidBatch",
    "Keys",
    "LayoutError",
    "Manifest",
    "RedisUnavailable",
    "RolloutBatch",
    "VersionGone",
    "VersionInfo",
    "WeightcastError",
    "WeightsClient",
    "WeightsError",
]

if TYPE_CHECKING:
    from weightcast.client.producer import (
        AsyncBatchProducer,
        BackPressureTimeout,
        BatchProducer,
    )
    from weightcast.client.weights import AsyncWeightsClient, WeightsClient
    from weightcast.contract.codec import BatchLimits, RolloutBatch
    from weightcast.contract.errors import (
        ConfigError,
        InvalidBatch,
        LayoutError,
        RedisUnavailable,
        VersionGone,
        WeightcastError,
        WeightsError,
    )
    from weightcast.contract.keys import Keys
    from weightcast.contract.manifest import Manifest
    from weightcast.contract.version_info import VersionInfo


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightcast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
