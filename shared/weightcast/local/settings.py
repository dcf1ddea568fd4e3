"""The settings of the loop on one machine: ``weightcast up`` (``[up]``), the stand-in
producer (``[produce]``) and the toy rollout task of ``follow --rollout`` (``[rollout]``),
read by this package.

Declared here and composed into the one configuration by :mod:`weightcast.runtime.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from weightcast.runtime.spec import setting

ROLLOUT_ENGINES = ("transformers", "vllm", "sglang")
UP_WORKDIR = Path(".weightcast/runs")
UP_STORES = ("directory", "s3")


@dataclass
class ProduceConfig:
    COMMANDS: ClassVar[tuple[str, ...]] = ("produce",)

    count: int = setting(1, "batches to push", flag="--count", ge=0)
    batch_size: int = setting(4, "sequences per batch", flag="--batch-size", ge=1)
    seq_len: int = setting(64, "tokens per sequence", flag="--seq-len", ge=2)
    vocab_size: int = setting(1024, "token ids are below this", flag="--vocab-size", ge=1)
    interval: float = setting(
        0.0,
        "seconds to wait between batches (paces a demo like a real rollout fleet)",
        flag="--interval",
        ge=0,
    )
    invalid_every: int = setting(
        0,
        "also push a malformed batch after every N good ones (0: never); shows the "
        "dead-letter path",
        flag="--invalid-every",
        ge=0,
    )
    seed: int = setting(0, "random seed", flag="--seed")
    max_pending: int = setting(
        16,
        "back-pressure: wait while this many batches are undelivered to the trainer (0: never)",
        flag="--max-pending",
        ge=0,
    )
    timeout: float = setting(
        300.0,
        "give up (exit 1) when the trainer has not made room for this many seconds",
        flag="--timeout",
        gt=0,
    )


@dataclass
class RolloutConfig:
    """The toy RL task of ``weightcast follow --rollout`` (and ``weightcast up``).

    Each batch is ``prompts`` random prompts of ``prompt_len`` tokens, each sampled
    ``group_size`` times for ``completion_len`` tokens (a GRPO group). The reward of a
    completion is the fraction of its tokens below ``target_below``: learnable from a
    near-uniform start, checkable by anyone.
    """

    COMMANDS: ClassVar[tuple[str, ...]] = ("follow",)

    prompts: int = setting(4, "prompts per batch", flag="--prompts", ge=1)
    group_size: int = setting(8, "completions per prompt (GRPO)", flag="--group-size", ge=2)
    prompt_len: int = setting(8, "prompt tokens", flag="--prompt-len", ge=1)
    completion_len: int = setting(16, "sampled tokens", flag="--completion-len", ge=1)
    target_below: int = setting(
        32, "rewarded token ids are below this", flag="--target-below", ge=1
    )
    vocab_size: int = setting(
        1024,
        "only for version 0 (nothing published yet): the uniform policy's vocabulary",
        flag="--vocab-size",
        ge=1,
    )
    max_pending: int = setting(
        2,
        "back-pressure: keep the rollouts at most this many batches ahead of the trainer",
        flag="--max-pending",
        ge=0,
    )
    timeout: float = setting(
        600.0, "give up when the trainer has not made room for this many seconds", gt=0
    )
    seed: int = setting(0, "random seed of prompts and sampling", flag="--seed")
    engine: str = setting(
        "transformers",
        "what the rollout node samples with: transformers (fp32, in the node's process) or "
        "vllm (a vLLM engine on CPU or GPU, updated through the weightcast backend) or sglang (an "
        "SGLang engine, updated through its weight-update API; up then publishes the hf layout)",
        flag="--engine",
        commands=("up", "follow"),
        choices=ROLLOUT_ENGINES,
    )


@dataclass
class UpConfig:
    """``weightcast up``: the whole loop on one machine, for a fixed number of steps."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("up",)

    steps: int = setting(40, "training steps", flag="--steps", ge=1)
    publish_every: int = setting(2, "snapshot every K steps", flag="--publish-every", ge=1)
    workdir: Path = setting(UP_WORKDIR, "each run gets a directory here", flag="--workdir")
    timeout: float = setting(900.0, "give up after this many seconds", flag="--timeout", gt=0)
    lr: float = setting(
        1e-2,
        "the learning rate up gives its trainer unless trainer.lr is set (the tiny model then "
        "learns the toy task within the default steps)",
        flag="--lr",
        gt=0,
    )
    store: str = setting(
        "directory",
        "where versions go: directory (the run's weights directory, read by the node) or s3 "
        "(a private S3 server, SeaweedFS, from the s3-server extra; the node reads only the "
        "bucket)",
        flag="--store",
        choices=UP_STORES,
    )
    vllm_python: str = setting(
        "",
        "the Python that runs the rollout node with --engine vllm (vLLM and weightcast "
        "installed); empty means .venv-vllm/bin/python when it exists (make vllm-setup)",
        flag="--vllm-python",
    )
    sglang_python: str = setting(
        "",
        "the Python that runs the rollout node with --engine sglang (SGLang and weightcast "
        "installed); empty means .venv-sglang/bin/python when it exists (make sglang-setup)",
        flag="--sglang-python",
    )
