"""An inference node's settings (``[follow]``, ``weightcast follow``; ``status`` reads
``stale_seconds``), read by :mod:`weightcast.cli.follow` and the vLLM server node.

Declared here, in the lowest package a node's code owns, and composed into the one
configuration by :mod:`weightcast.runtime.config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from weightcast.runtime.spec import metrics_port, setting

PAUSE_MODES = ("wait", "abort")
SGLANG_PAUSE_MODES = ("wait", "abort", "retract", "in_place")


@dataclass
class FollowConfig:
    COMMANDS: ClassVar[tuple[str, ...]] = ("follow",)

    node_id: str = setting("", "name in {wc}:nodes; empty means <hostname>-<pid>", flag="--node-id")
    poll_seconds: float = setting(
        2.0, "re-read latest (and re-report the node) this often", flag="--poll-seconds", gt=0
    )
    lease_seconds: float = setting(30.0, "lease time to live", flag="--lease-seconds", gt=0)
    max_delta_chain: int = setting(
        16,
        "a node that keeps its base and is several versions behind applies at most this "
        "many deltas in a row (when together they are smaller than the version) before it "
        "reads the version whole; 1 applies only the delta from the version held",
        flag="--max-delta-chain",
        ge=1,
        le=1024,
    )
    until_version: int = setting(
        0,
        "exit once this version (or a newer one) is loaded; 0 follows forever",
        flag="--until-version",
        ge=0,
    )
    stale_seconds: float = setting(
        60.0,
        "weightcast status marks a node stale when it has not reported for this long",
        flag="--stale-seconds",
        commands=("status",),
        gt=0,
    )
    rollout: bool = setting(
        False,
        "also be the rollout producer: sample from the loaded version and push scored batches",
        flag="--rollout",
    )
    metrics_port: int = metrics_port("/healthz")
    vllm_url: str = setting(
        "",
        "keep the `vllm serve` at this URL on the newest version instead of loading versions "
        "here (the server runs the weightcast backend, with VLLM_SERVER_DEV_MODE=1)",
        flag="--vllm-url",
        pattern=re.compile(r"^(https?://\S+)?$"),
        pattern_text="empty, or an http:// or https:// URL",
    )
    vllm_weights_dir: str = setting(
        "",
        "the weights directory as the vLLM server's workers see it; empty means weights_dir",
        flag="--vllm-weights-dir",
    )
    vllm_timeout_seconds: float = setting(
        600.0,
        "longest wait for one call to the vLLM server (a pause waits for running requests)",
        flag="--vllm-timeout-seconds",
        gt=0,
    )
    vllm_pause_mode: str = setting(
        "wait",
        "how the vLLM server pauses for an update: wait lets running requests finish, abort "
        "ends them; either way its KV cache (old weights) is cleared",
        flag="--vllm-pause-mode",
        choices=PAUSE_MODES,
    )
    sglang_url: str = setting(
        "",
        "keep the SGLang server at this URL (on this host) on the newest version instead of "
        "loading versions here",
        flag="--sglang-url",
        pattern=re.compile(r"^(https?://\S+)?$"),
        pattern_text="empty, or an http:// or https:// URL",
    )
    sglang_timeout_seconds: float = setting(
        600.0,
        "longest wait for one call to the SGLang server",
        flag="--sglang-timeout-seconds",
        gt=0,
    )
    sglang_pause_mode: str = setting(
        "wait",
        "how the SGLang server pauses for an update: wait (no pause; the update runs between "
        "two scheduler steps), or SGLang's abort, retract, in_place",
        flag="--sglang-pause-mode",
        choices=SGLANG_PAUSE_MODES,
    )
