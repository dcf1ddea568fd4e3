"""The ``weightcast`` command: one console script for every process of the pipeline.

Every command's flags come from the settings' declarations (:mod:`weightcast.runtime.config`);
the daemons are imported only by the command that runs them, so ``weightcast status`` stays
quick and the core install (no trainer, no publisher) runs every client command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import redis

from weightcast.contract.errors import ConfigError, WeightcastError
from weightcast.runtime.config import COMMANDS, Config
from weightcast.runtime.dirs import check_writable_dir
from weightcast.runtime.logs import configure_logging
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.retry import access_denied, access_error
from weightcast.runtime.settings import add_flags, flag_overrides, load_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcast",
        description="Move fresh policy weights from an RL trainer to "
        "inference nodes through Redis.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        command.add_argument(
            "--config",
            type=Path,
            metavar="FILE",
            help="TOML settings file (flags and WEIGHTCAST_* env override it)",
        )
        add_flags(command, name)
        if name == "up":
            command.add_argument(
                "--redis-url",
                dest="redis_url",
                default=argparse.SUPPRESS,
                help="use this Redis (under the namespace up-<time> unless "
                "--namespace is given) instead of a private redis-server",
            )
        if name == "status":
            command.add_argument("--json", action="store_true", help="print JSON")
            command.add_argument(
                "--watch",
                nargs="?",
                type=float,
                const=2.0,
                metavar="SECONDS",
                help="refresh in place every SECONDS (default 2) until Ctrl-C",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prefix = f"weightcast {args.command}"
    try:
        config = load_config(args.config, overrides=flag_overrides(args))
        for name, path in writable_dirs(config, args.command).items():
            check_writable_dir(Path(path), name)
        configure_logging(config.common.log_format, config.common.log_level)
        return _run(args, config)
    except ConfigError as exc:
        print(f"{prefix}: configuration error: {exc}", file=sys.stderr)
        return 2
    except WeightcastError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        if access_denied(exc):  # a call made outside an Outage: the same one line
            denied = access_error(exc, "talking to Redis")
            print(f"{prefix}: configuration error: {denied}", file=sys.stderr)
            return 2
        if not isinstance(exc, redis.ConnectionError):
            raise
        print(
            f"{prefix}: cannot reach Redis at {config.common.redis_url}: "
            f"{exc}. Start redis-server or pass --redis-url.",
            file=sys.stderr,
        )
        return 1


def writable_dirs(config: Config, command: str) -> dict[str, Path]:
    """The directories ``command`` writes, by setting name (checked before it starts; the
    trainer checks its own once its starting checkpoint is known to be good)."""
    common = config.common
    if command == "publisher":
        return {"checkpoint_dir": common.checkpoint_dir, "weights_dir": common.weights_dir}
    if command == "up":
        return {"up.workdir": config.up.workdir}
    return {}


def _run(args: argparse.Namespace, config: Config) -> int:
    if args.command == "up":
        from weightcast.local.up import UpOptions, run_up

        given = vars(args)
        options = UpOptions(
            redis_url=given.get("redis_url"),
            own_namespace="redis_url" in given and "namespace" not in given,
            config_file=args.config,
        )
        return run_up(config, options)
    if args.command == "trainer":
        from weightcast_trainer.main import run_trainer

        return run_trainer(config)
    if args.command == "publisher":
        from weightcast_publisher.daemon import run_publisher

        return run_publisher(config)
    if args.command == "produce":
        from weightcast.local.produce import run_produce

        return run_produce(config)
    if args.command == "follow":
        from weightcast.cli.follow import run_follow

        return run_follow(config)
    from weightcast.cli.status import Status, collect_status, format_status, watch
    from weightcast.contract.keys import Keys
    from weightcast.runtime.retry import Outage

    client = redis_client(config.common.redis_url)
    keys = Keys(config.common.namespace)

    def read() -> Status:
        return collect_status(client, keys, config.follow.stale_seconds)

    if args.watch is not None:
        outage = Outage(budget=config.common.redis_retry_seconds, cap=max(args.watch, 2.0))
        return watch(read, args.watch, args.json, outage=outage)
    status = read()
    print(json.dumps(status.as_json(), indent=1) if args.json else format_status(status))
    return 0
