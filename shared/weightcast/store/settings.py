"""Where versions live: the object store's settings (top level of the TOML file).

They belong to the common section (``config.common.weights_url``...): the publisher writes
there and every node reads there. :mod:`weightcast.runtime.config` composes them into it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from weightcast.runtime.spec import setting

WEIGHTS_DIR = Path("weights")
S3_URL = re.compile(r"^(|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^?#@]*)?)$")
HTTP_URL = re.compile(r"^(|https?://[^\s@]+)$")
STORE_COMMANDS = ("publisher", "follow")
"""The commands that reach the object store themselves (the others name weights_dir only)."""


@dataclass
class StoreSettings:
    weights_dir: Path = setting(
        WEIGHTS_DIR,
        "where the publisher writes versions and inference nodes read them",
        flag="--weights-dir",
        commands=("trainer", "publisher", "produce", "follow", "status"),
    )
    weights_url: str = setting(
        "",
        "an s3://bucket/prefix URL: versions live in that bucket (any S3-compatible server), "
        "weights_dir stays the publisher's local copy and nodes need no view of it; empty: "
        "versions live in weights_dir. Credentials come from the AWS environment or profile",
        flag="--weights-url",
        commands=STORE_COMMANDS,
        pattern=S3_URL,
        pattern_text="empty, or an s3://bucket/prefix URL (no credentials, no query)",
    )
    s3_endpoint_url: str = setting(
        "",
        "the S3-compatible server of weights_url (http://host:port); empty: AWS, or "
        "AWS_ENDPOINT_URL",
        flag="--s3-endpoint-url",
        commands=STORE_COMMANDS,
        pattern=HTTP_URL,
        pattern_text="empty, or an http:// or https:// URL",
    )
    s3_region: str = setting(
        "",
        "the region of weights_url's bucket; empty: AWS_REGION or the AWS profile's",
        flag="--s3-region",
        commands=STORE_COMMANDS,
    )
    s3_addressing_style: str = setting(
        "auto",
        "how requests name the bucket: path (most S3-compatible servers), virtual, or auto",
        flag="--s3-addressing-style",
        commands=STORE_COMMANDS,
        choices=("auto", "path", "virtual"),
    )
    store_retry_seconds: float = setting(
        60.0,
        "how long one call to the object store is retried through throttling, 5xx answers "
        "and lost connections (capped exponential back-off) before it counts as an outage",
        flag="--store-retry-seconds",
        commands=STORE_COMMANDS,
        ge=1,
    )

    def weights_location(self) -> str:
        """Where nodes read versions: ``weights_url`` with the S3 settings as its options
        (one string a node hands its other processes), or ``weights_dir``."""
        if not self.weights_url:
            return str(self.weights_dir)
        options = {
            "endpoint_url": self.s3_endpoint_url,
            "region": self.s3_region,
            "addressing_style": ""
            if self.s3_addressing_style == "auto"
            else self.s3_addressing_style,
        }
        query = urlencode({k: v for k, v in options.items() if v})
        return f"{self.weights_url}?{query}" if query else self.weights_url
