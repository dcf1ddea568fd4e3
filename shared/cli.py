"""The ``weightcast`` command: one console script for every process of the pipeline."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import redis

from shared.config import Config, ConfigError, add_flag, flag_overrides, load_config
from shared.logs import configure_logging
from shared.stack import UpOptions

COMMANDS = {
    "up": "run the whole pipeline locally (private redis-server, tiny model, CPU) and exit",
    "trainer": "train on rollout batches from Redis and write snapshots (torchrun works)",
    "publisher": "publish complete snapshots as vllm-fused versions and evict old ones",
    "produce": "push synthetic rollout batches (a stand-in rollout producer)",
    "follow": "a reference inference node: lease, verify and load each new version",
    "status": "show versions, leases, nodes, the trainer and the batch queue",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcast",
        description="Move fresh policy weights from an RL trainer to "
        "inference nodes through Redis.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {
        name: sub.add_parser(name, help=text, description=text) for name, text in COMMANDS.items()
    }
    for name, command in commands.items():
        command.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            help="TOML settings file (flags and WEIGHTCAST_* env override it)",
        )
        if name == "up":
            command.add_argument(
                "--redis-url",
                dest="redis_url",
                default=argparse.SUPPRESS,
                help="use this Redis (under the namespace up-<time> unless "
                "--namespace is given) instead of a private redis-server",
            )
        else:
            add_flag(command, "redis_url", "--redis-url", help="Redis to use")
        add_flag(command, "namespace", "--namespace", help="key namespace (hash tag)")
        if name != "up":  # up keeps every file of a run in the run's own directory
            add_flag(command, "checkpoint_dir", "--checkpoint-dir", help="snapshot directory")
            add_flag(command, "weights_dir", "--weights-dir", help="published versions directory")
        add_flag(command, "log_format", "--log-format", help="text or json")
        add_flag(command, "log_level", "--log-level", help="DEBUG, INFO, WARNING...")

    up = commands["up"]
    defaults = UpOptions()
    up.add_argument(
        "--steps", type=int, default=defaults.steps, help="training steps (default: %(default)s)"
    )
    up.add_argument(
        "--publish-every",
        type=int,
        default=defaults.publish_every,
        help="snapshot every K steps (default: %(default)s)",
    )
    up.add_argument(
        "--workdir",
        type=Path,
        default=defaults.workdir,
        help="each run gets a directory here (default: %(default)s)",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=defaults.timeout,
        help="give up after this many seconds (default: %(default)s)",
    )

    trainer = commands["trainer"]
    add_flag(trainer, "trainer.model", "--model", help="Qwen3 flavor")
    add_flag(trainer, "trainer.steps", "--steps", help="optimizer steps, 0 = until stopped")
    add_flag(trainer, "trainer.publish_every", "--publish-every", help="snapshot every K steps")
    add_flag(trainer, "trainer.seq_len", "--seq-len", help="longest batch, in tokens")
    add_flag(trainer, "trainer.loss", "--loss", help="grpo, sft or package.module:function")
    add_flag(trainer, "trainer.kl_coef", "--kl-coef", help="weight of the k3 KL to the reference")
    add_flag(trainer, "trainer.clip_eps", "--clip-eps", help="importance ratio clipping")
    add_flag(
        trainer,
        "trainer.micro_batches",
        "--micro-batches",
        help="stream entries per optimizer step",
    )
    add_flag(
        trainer,
        "trainer.max_policy_lag",
        "--max-policy-lag",
        help="drop batches this many versions older than the latest (negative: keep all)",
    )
    add_flag(trainer, "trainer.resume_dir", "--resume-dir", help="resume checkpoint directory")
    add_flag(
        trainer, "trainer.max_deliveries", "--max-deliveries", help="dead-letter after N deliveries"
    )
    add_flag(
        trainer,
        "trainer.claim_idle_s",
        "--claim-idle-s",
        help="claim entries other consumers left pending this long",
    )
    add_flag(
        trainer,
        "trainer.trim_stream",
        "--trim-stream",
        help="delete stream entries every group has acknowledged after each checkpoint",
    )
    add_flag(trainer, "trainer.consumer", "--consumer", help="consumer name in group trainer")
    add_flag(trainer, "trainer.run_id", "--run-id", help="run id written into snapshots")
    add_flag(trainer, "trainer.metrics_port", "--metrics-port", help="/metrics and /healthz port")

    publisher = commands["publisher"]
    add_flag(publisher, "publisher.tp", "--tp", help="inference tensor-parallel degree")
    add_flag(publisher, "publisher.keep", "--keep", help="versions to keep")
    add_flag(
        publisher,
        "publisher.rescan_seconds",
        "--rescan-seconds",
        help="rescan the checkpoint directory at least this often",
    )
    add_flag(publisher, "publisher.poll", "--poll", help="polling observer (NFS)")
    add_flag(publisher, "publisher.once", "--once", help="publish what is complete, then exit")
    add_flag(
        publisher, "publisher.metrics_port", "--metrics-port", help="/metrics and /healthz port"
    )
    add_flag(publisher, "publisher.layout", "--layout", help="vllm-fused, hf or both")
    add_flag(
        publisher,
        "publisher.per_rank_files",
        "--per-rank-files",
        help="one file per tp rank holding only that rank's parameters",
    )
    add_flag(publisher, "publisher.reader", "--reader", help="auto (byte ranges) or dcp-load")
    add_flag(
        publisher,
        "publisher.leader_ttl_seconds",
        "--leader-ttl-seconds",
        help="publisher lock TTL (standby takeover time)",
    )
    add_flag(
        publisher,
        "publisher.retry_max_seconds",
        "--retry-max-seconds",
        help="longest back-off after a Redis or disk failure",
    )
    add_flag(
        publisher,
        "publisher.keep_quarantined",
        "--keep-quarantined",
        help="quarantined snapshots kept on disk",
    )

    produce = commands["produce"]
    add_flag(produce, "produce.count", "--count", help="batches to push")
    add_flag(produce, "produce.batch_size", "--batch-size", help="sequences per batch")
    add_flag(produce, "produce.seq_len", "--seq-len", help="tokens per sequence")
    add_flag(produce, "produce.vocab_size", "--vocab-size", help="token ids are below this")
    add_flag(produce, "produce.interval", "--interval", help="seconds between batches")
    add_flag(
        produce,
        "produce.invalid_every",
        "--invalid-every",
        help="also push a malformed batch after every N good ones",
    )
    add_flag(produce, "produce.seed", "--seed", help="random seed")
    add_flag(
        produce,
        "produce.max_pending",
        "--max-pending",
        help="wait while this many batches are undelivered to the trainer (0: never)",
    )
    add_flag(
        produce, "produce.timeout", "--timeout", help="give up waiting after this many seconds"
    )

    follow = commands["follow"]
    add_flag(follow, "follow.node_id", "--node-id", help="name of this node")
    add_flag(follow, "follow.poll_seconds", "--poll-seconds", help="re-read latest this often")
    add_flag(follow, "follow.lease_seconds", "--lease-seconds", help="lease time to live")
    add_flag(
        follow, "follow.until_version", "--until-version", help="exit once this version is loaded"
    )
    add_flag(
        follow,
        "follow.rollout",
        "--rollout",
        help="also be the rollout producer: sample, score and push batches for the trainer",
    )
    add_flag(follow, "rollout.prompts", "--prompts", help="prompts per batch")
    add_flag(follow, "rollout.group_size", "--group-size", help="completions per prompt (GRPO)")
    add_flag(follow, "rollout.prompt_len", "--prompt-len", help="prompt tokens")
    add_flag(follow, "rollout.completion_len", "--completion-len", help="sampled tokens")
    add_flag(
        follow, "rollout.target_below", "--target-below", help="rewarded token ids are below this"
    )
    add_flag(
        follow,
        "rollout.max_pending",
        "--max-pending",
        help="keep at most this many rollout batches queued for the trainer",
    )
    add_flag(follow, "rollout.seed", "--seed", help="random seed of prompts and sampling")

    status = commands["status"]
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh in place every SECONDS (default 2) until Ctrl-C",
    )
    add_flag(
        status,
        "follow.stale_seconds",
        "--stale-seconds",
        help="mark a node stale when it has not reported for this long",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, overrides=flag_overrides(args))
        configure_logging(config.common.log_format, config.common.log_level)
        return _run(args, config)
    except ConfigError as exc:
        print(f"weightcast {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except redis.ConnectionError as exc:
        print(
            f"weightcast {args.command}: cannot reach Redis at {config.common.redis_url}: "
            f"{exc}. Start redis-server or pass --redis-url.",
            file=sys.stderr,
        )
        return 1


def _run(args: argparse.Namespace, config: Config) -> int:
    if args.command == "up":
        from shared.stack import run_up

        given = vars(args)
        options = UpOptions(
            steps=args.steps,
            publish_every=args.publish_every,
            workdir=args.workdir,
            timeout=args.timeout,
            redis_url=given.get("redis_url"),
            own_namespace="redis_url" in given and "namespace" not in given,
            config_file=args.config,
        )
        return run_up(config, options)
    if args.command == "trainer":
        from trainer.worker import run_trainer

        return run_trainer(config)
    if args.command == "publisher":
        from publisher.daemon import run_publisher

        return run_publisher(config)
    if args.command == "produce":
        from shared.producer import run_produce

        return run_produce(config)
    if args.command == "follow":
        from shared.follower import run_follow

        return run_follow(config)
    from shared.keys import Keys
    from shared.status import collect_status, format_status, watch

    client = redis.Redis.from_url(config.common.redis_url)
    keys = Keys(config.common.namespace)

    def read() -> dict:
        return collect_status(client, keys, config.follow.stale_seconds)

    if args.watch is not None:
        return watch(read, args.watch, args.json)
    status = read()
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
