"""The rollout node's vLLM engine (``up --engine vllm``) rides out a version evicted between
the registry naming it newest and the node leasing it: the node waits for the next one.

Under load the engine starts slowly; a trainer publishing every few steps then evicts the
version the node had read as newest before the node leases it. That ended the node
(``version 1 is no longer live``, seen in a ``make test`` run of ``test_up_vllm.py``).
"""

from __future__ import annotations

from weightcast.client.node import Node
from weightcast.local.vllm_rollout import VllmPolicies
from weightcast.runtime.settings import load_config

from vllm_helpers import Registry


def test_a_version_evicted_before_the_engine_leases_it_is_skipped(registry: Registry) -> None:
    config = load_config(
        env={},
        overrides={
            "redis_url": registry.redis_url,
            "namespace": registry.namespace,
            "weights_dir": registry.weights_dir,
        },
    )
    client = registry.client("rollout")
    gone = max(registry.versions, default=0) + 1  # latest() just before its eviction
    client.latest = lambda: gone  # type: ignore[method-assign]
    node = Node(client, report_every=60)
    policies = VllmPolicies(config, node)
    placeholder = type("Placeholder", (), {"version": 0})()
    assert policies.refresh(placeholder) is None
    assert policies.llm is None  # nothing started for a version that is gone
    assert node.seen == 0, "an evicted version is not marked tried: a later one is loaded"
    client.close()
