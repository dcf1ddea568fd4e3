"""The publisher's Prometheus metrics, on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320)


class PublisherMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.publish_seconds = Histogram(
            "weightcast_publish_seconds",
            "Conversion, fsync and registration of one version",
            buckets=_SECONDS,
            registry=r,
        )
        self.upload_seconds = Histogram(
            "weightcast_upload_seconds",
            "Upload of one version to the object store (weights_url), before its registration",
            buckets=_SECONDS,
            registry=r,
        )
        self.lag_seconds = Histogram(
            "weightcast_publish_lag_seconds",
            "From the snapshot's creation to the version's registration",
            buckets=_SECONDS,
            registry=r,
        )
        self.bytes = Counter(
            "weightcast_published_bytes", "Bytes written into published versions", registry=r
        )
        self.versions = Counter(
            "weightcast_versions_published", "Versions registered", ["reader"], registry=r
        )
        self.skipped = Counter(
            "weightcast_snapshots_skipped", "Snapshots skipped for a newer one", registry=r
        )
        self.quarantined = Counter(
            "weightcast_snapshots_quarantined", "Snapshots moved to quarantine", registry=r
        )
        self.evicted = Counter("weightcast_versions_evicted", "Versions evicted", registry=r)
        self.trimmed = Counter(
            "weightcast_versions_trimmed",
            "Versions evicted whose delta was kept (delta-only)",
            registry=r,
        )
        self.lease_waits = Counter(
            "weightcast_eviction_lease_waits",
            "Evictions postponed because a reader held a lease",
            registry=r,
        )
        self.errors = Counter(
            "weightcast_publisher_errors",
            "Failures the publisher retries (redis, disk, store, store_full)",
            ["kind"],
            registry=r,
        )
        self.deltas_dropped = Counter(
            "weightcast_deltas_dropped",
            "Versions published without their delta from the one before, by why: too_large "
            "(it stopped paying), behind (its encoding fell behind the write), other",
            ["reason"],
            registry=r,
        )
        self.latest = Gauge("weightcast_latest_version", "Newest version registered", registry=r)
        self.leader = Gauge(
            "weightcast_publisher_leader", "1 while this publisher holds the lock", registry=r
        )

    def render(self) -> bytes:
        """The metrics in Prometheus' text format, for ``/metrics``."""
        return generate_latest(self.registry)
