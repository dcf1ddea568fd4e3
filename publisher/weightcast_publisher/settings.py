"""The publisher's settings (``[publisher]``, ``weightcast publisher``), read by this package.

Declared here, beside the daemon that reads them, and composed into the one configuration by
:mod:`weightcast.runtime.config`, so that the core install's CLI parses, checks and documents
them without the publisher's dependencies: this module imports nothing but the declaration
helpers and the contract's names (an import-linter contract keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from weightcast.contract.fp8 import QUANTIZE_CHOICES
from weightcast.contract.layout import LAYOUTS
from weightcast.contract.manifest import DEFAULT_DIGEST, DIGESTS
from weightcast.runtime.spec import metrics_port, setting

READERS = ("auto", "dcp-load")


@dataclass
class PublisherConfig:
    COMMANDS: ClassVar[tuple[str, ...]] = ("publisher",)

    tp: int = setting(
        1,
        "inference tensor-parallel degree the fused layout is cut for (vLLM splits Qwen3's 8 "
        "kv heads, so a tp that is not a power of two fits no released size)",
        flag="--tp",
        ge=1,
        le=512,
        power_of_two=True,
    )
    keep: int = setting(2, "versions to keep (plus any a reader leases)", flag="--keep", ge=1)
    rescan_seconds: float = setting(
        5.0, "rescan the checkpoint directory at least this often", flag="--rescan-seconds", gt=0
    )
    poll: bool = setting(
        False, "use watchdog's polling observer (NFS and other network filesystems)", flag="--poll"
    )
    once: bool = setting(
        False, "publish what is complete at start, then exit (scripts and tests)", flag="--once"
    )
    metrics_port: int = metrics_port("Prometheus /metrics and /healthz")
    layout: str = setting(
        "vllm-fused",
        "vllm-fused, hf (plain HF shards and index) or both (HF in v<N>/hf/)",
        flag="--layout",
        choices=LAYOUTS,
    )
    per_rank_files: bool = setting(
        False,
        "with tp > 1, one safetensors file per rank holding exactly that rank's parameters",
        flag="--per-rank-files",
    )
    expert_parallel: bool = setting(
        False,
        "mixtures of experts: lay experts out for vLLM's --enable-expert-parallel (whole "
        "experts per rank, ep = tp; tp must divide the experts) instead of splitting each "
        "expert's intermediate dimension over the tp ranks",
        flag="--expert-parallel",
    )
    quantize: str = setting(
        "none",
        "fp8: publish linear weights as block-scaled FP8 (e4m3, a float32 scale per 128x128 "
        "block, as the published Qwen3 FP8 checkpoints; embedding, norms, router and lm_head "
        "stay bf16) that vLLM serves with its FP8 kernels; none: as the snapshot holds them",
        flag="--quantize",
        commands=("publisher", "up"),
        choices=QUANTIZE_CHOICES,
    )
    reader: str = setting(
        "auto",
        "auto: copy byte ranges out of the snapshot's files (dcp-safetensors snapshots); "
        "dcp-load: load every snapshot with dcp.load (always the case for dcp-torchsave ones)",
        flag="--reader",
        choices=READERS,
    )
    digest: str = setting(
        DEFAULT_DIGEST,
        "per-block digest of published files: xxh3-128 catches corruption; blake3 (a "
        "cryptographic hash, pip install blake3) also resists tampering with the files",
        flag="--digest",
        choices=DIGESTS,
    )
    delta: bool = setting(
        True,
        "write beside each version a delta from the previous one (the changed bytes of each "
        "digest block, xor-sparse) when their layouts match; nodes that hold the previous "
        "version read only it",
        flag="--delta",
    )
    delta_max_ratio: float = setting(
        0.5,
        "stop encoding a version's delta (the version is published without one, the reason "
        "logged and registered) once it holds more than this fraction of the bytes it covers: "
        "a node would read nearly the whole version anyway, and the publisher pay the encoding",
        flag="--delta-max-ratio",
        gt=0,
        le=1,
    )
    delta_behind: str = setting(
        "auto",
        "what a delta whose encoding falls behind the write does: auto (the write waits for "
        "it while the waits stay within a third of the write's time: one node's read saved "
        "pays for that), drop (at once: the version is never later than without deltas) or "
        "wait (as long as it takes: every version keeps its delta, for many nodes or a "
        "bucket on other hosts)",
        flag="--delta-behind",
        choices=("auto", "drop", "wait"),
    )
    delta_window: int = setting(
        8,
        "delta-only versions kept beyond the `keep` full ones: an evicted version's full "
        "files go but its manifest, config and delta stay while it is among the newest this "
        "many, so a node several versions behind reads the chain of deltas instead of the "
        "version whole (0: evicted versions go whole, as before)",
        flag="--delta-window",
        ge=0,
        le=1024,
    )
    leader_ttl_seconds: float = setting(
        10.0,
        "TTL of the publisher lock; a standby takes over within it when the leader dies",
        flag="--leader-ttl-seconds",
        gt=0,
    )
    retry_max_seconds: float = setting(
        30.0,
        "longest back-off between retries after a Redis outage or a full disk",
        flag="--retry-max-seconds",
        gt=0,
    )
    keep_quarantined: int = setting(
        5,
        "quarantined snapshots kept on disk (newest first); older ones are deleted",
        flag="--keep-quarantined",
        ge=0,
    )
    keep_records: int = setting(
        1000,
        "records of handled and of quarantined snapshots kept in Redis (newest first); older "
        "ones are deleted",
        flag="--keep-records",
        ge=10,
    )
    node_retention_seconds: float = setting(
        86400.0,
        "a node that has not reported for this long is removed from {wc}:nodes (and status)",
        flag="--node-retention-seconds",
        ge=60,
    )
