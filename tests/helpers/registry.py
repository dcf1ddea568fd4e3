"""A namespace of versions written by the real publisher, one snapshot per version, for the
real-engine tiers (tests/vllm, tests/sglang)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import torch

from weightcast.client.weights import WeightsClient
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import ModelShape
from weightcast.runtime.settings import load_config
from weightcast_publisher.daemon import Publisher

from helpers.models import plausible_state
from helpers.snapshots import write_snapshot


def random_state(config: Mapping[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """:func:`helpers.models.plausible_state` of the model ``config`` describes."""
    return plausible_state(ModelShape.from_hf_config(config), seed)


@dataclass
class Registry:
    """A namespace whose versions the real publisher writes, one snapshot per version."""

    redis_url: str
    namespace: str
    root: Path
    step: int = 0
    versions: dict[int, Path] = field(default_factory=dict)
    publisher: dict[str, Any] = field(default_factory=dict)
    """``publisher.*`` settings of every publish beside the registry's own (``delta_behind``)."""

    @property
    def weights_dir(self) -> Path:
        return self.root / "weights"

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace)

    def publish(
        self,
        config: Mapping[str, Any],
        state: dict[str, torch.Tensor],
        tp: int = 1,
        layout: str = "vllm-fused",
        per_rank_files: bool = False,
        expert_parallel: bool = False,
        quantize: str = "none",
    ) -> int:
        """Write ``state`` as the trainer's next snapshot and run one pass of the publisher
        (in this process, with these layout settings); the new version's number."""
        self.step += 1
        snapshot = write_snapshot(
            self.root / "checkpoints", self.step, ModelShape.from_hf_config(config), state
        )
        (snapshot / "config.json").write_text(json.dumps(config))
        settings = {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "checkpoint_dir": self.root / "checkpoints",
            "weights_dir": self.weights_dir,
            "publisher.tp": tp,
            "publisher.layout": layout,
            "publisher.per_rank_files": per_rank_files,
            "publisher.expert_parallel": expert_parallel,
            "publisher.quantize": quantize,
            "publisher.keep": 1000,
            # The tier's versions are unrelated random states: keep their deltas whatever
            # their size, so that engines load by delta (the default drops a delta over half
            # the version; tests/integration/test_delta_publish.py covers that).
            "publisher.delta_max_ratio": 1.0,
            **{f"publisher.{name}": value for name, value in self.publisher.items()},
        }
        publisher = Publisher(load_config(env={}, overrides=settings))
        try:
            publisher.scan_once()
        finally:
            publisher.lock.release()
        client = redis.Redis.from_url(self.redis_url)
        version = int(client.get(self.keys.latest))
        path = client.hget(self.keys.version(version), "path").decode()  # relative to the root
        self.versions[version] = Path(self.weights_dir) / path
        client.close()
        return version

    def client(self, node_id: str, keep_base: bool = False) -> WeightsClient:
        """A node's client of this registry's versions (``keep_base``: read by delta)."""
        return WeightsClient(
            self.redis_url,
            self.weights_dir,
            namespace=self.namespace,
            node_id=node_id,
            keep_base=keep_base,
        )

    def location(self, node_id: str) -> dict[str, str]:
        """The backend's ``init_info`` for versions of this registry."""
        return {
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "weights_root": str(self.weights_dir),
            "node_id": node_id,
        }

    def leases(self, version: int) -> list[str]:
        client = redis.Redis.from_url(self.redis_url)
        members = client.zrange(self.keys.leases(version), 0, -1)
        client.close()
        return sorted(m.decode() for m in members)


def flip_byte(path: Path) -> None:
    """Corrupt a file in the middle of its tensor data (its size stays the same)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@dataclass
class Versions:
    """Named versions of one model, the states they hold, and their registry."""

    registry: Registry
    number: dict[str, int]
    states: dict[str, dict[str, torch.Tensor]]

    def path(self, name: str) -> Path:
        return self.registry.versions[self.number[name]]

    def hf_dir(self, name: str) -> Path:
        """The version's HF layout (``both`` puts it in ``hf/``)."""
        path = self.path(name)
        return path / "hf" if (path / "hf").is_dir() else path
