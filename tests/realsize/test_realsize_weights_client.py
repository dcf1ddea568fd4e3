"""A ``WeightsClient`` node that keeps its base (what ``weightcast follow`` runs) walks the
0.6B versions from the weights directory and from the bucket: full read, deltas, a corrupt
version refused with the held tensors untouched, a broken chain read whole, a chain of 3, a
return to an older version. At this size every tensor spans many blocks, ranged GETs and
staging windows, which the small models of the other tiers never do."""

from __future__ import annotations

import pytest
import torch

from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import WeightsError

from helpers.realsize import REFUSED, WALK, RealSizeVersions, bytes_digest


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: bytes_digest(t) for name, t in tensors.items()}


@pytest.mark.parametrize("where", ["directory", "bucket"])
def test_a_node_walks_the_versions_and_holds_each_bitwise(
    realsize: RealSizeVersions, where: str
) -> None:
    deployment = realsize.deployment
    node = WeightsClient(
        deployment.redis_url,
        realsize.directory if where == "directory" else deployment.location,
        namespace=deployment.keys.namespace,
        node_id=f"realsize-{where}",
        keep_base=True,
    )
    held: dict[str, torch.Tensor] = {}
    try:
        for step in WALK:
            if step.via == REFUSED:
                # Its delta fails, then its full read: the reader let go of its base before
                # that read (one version in memory, not two), and the tensors the node holds
                # are still bitwise the version it served.
                served = node.reader.base.version
                with pytest.raises(WeightsError, match="digest"):
                    node.load(step.version)
                assert node.reader.base is None
                assert digests(held) == realsize.digests[served], step
                continue
            held = node.load(step.version)
            stats = node.reader.stats
            assert (stats.via, stats.links) == (step.via, {"full": 0, "delta": 1}.get(step.via, 3))
            assert digests(held) == realsize.digests[step.version], step
    finally:
        node.close()
    assert all(deployment.client.zcard(deployment.keys.leases(s.version)) == 0 for s in WALK)
