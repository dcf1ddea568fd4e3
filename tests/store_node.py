"""A node for the object-store process tests (run with ``tests`` on PYTHONPATH): follows the
versions in ``WEIGHTCAST_WEIGHTS_URL`` as ``weightcast follow`` does (keeping its base, so
each next version comes by delta), until ``--until``; then writes what it holds to
``--out`` (safetensors) and how each version came (JSON lines on stdout).

    python -m store_node --until 4 --out held.safetensors
"""

from __future__ import annotations

import argparse
import json
import os

from safetensors.torch import save_file

from weightcast.client.node import Node
from weightcast.client.weights import WeightsClient
from weightcast.runtime.settings import load_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = load_config(env=dict(os.environ))
    client = WeightsClient(
        config.common.redis_url,
        config.common.weights_location(),
        namespace=config.common.namespace,
        keep_base=True,
    )
    node = Node(client, report_every=60)
    held = None
    while node.current < args.until:
        version = client.wait_for_newer(node.seen, timeout=1, poll=0.2)
        if version is None:
            continue
        loaded = node.load(version)
        if loaded is not None:
            held = loaded
            print(json.dumps({"version": version, "via": client.reader.stats.via}), flush=True)
    assert held is not None
    save_file({k: v.contiguous() for k, v in held.tensors.items()}, args.out)
    client.close()


if __name__ == "__main__":
    main()
