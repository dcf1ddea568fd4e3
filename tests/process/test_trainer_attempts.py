"""Poison is what fails, not what was pending: failed attempts through real crashes.

A batch is dead-lettered after ``max_attempts`` steps that trained it and never finished;
restarts, re-deliveries and sharing a step with a poison batch count nothing against a good
batch, and an entry that cannot even be decoded is dead-lettered at once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import redis
import torch
from safetensors.torch import save

from weightcast.contract.keys import Keys
from weightcast.local.produce import synthetic_batch

from helpers.processes import (
    config_file,
    run_weightcast,
    start_weightcast,
    wait_for,
    with_namespace,
    with_test_modules,
)
from helpers.redis_state import dead_letters, push_batches, push_raw
from helpers.snapshots import checkpoint_model, final_train_state

NO_RESUME_CHECKPOINT = "[trainer.checkpoint]\ninterval = 1000\n"
"""Nothing is checkpointed (so nothing acknowledged) before the run's last step."""


def current_run(log: Path) -> str:
    """The output of the newest trainer process in ``log``."""
    return log.read_text().rpartition("trainer started")[2] if log.exists() else ""


def a_batch(seed: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(torch.Generator().manual_seed(seed), 2, 16, 1024)


def test_ten_sigkills_before_the_first_resume_checkpoint_lose_no_good_batch(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Each restart re-delivers every batch since the start; none may be dead-lettered, and
    the final model is the one an uninterrupted run on the same batches trains."""
    count = 24
    config = config_file(tmp_path, NO_RESUME_CHECKPOINT)
    args = ("trainer", "--config", config, "--publish-every", "1000", "--steps", str(count))
    reference_env = with_namespace(cli_env, tmp_path, "reference")
    push_batches(
        cli_env["WEIGHTCAST_REDIS_URL"], Keys(reference_env["WEIGHTCAST_NAMESPACE"]), count
    )
    uninterrupted = run_weightcast(reference_env, *args)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]

    produced = list(push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, count))
    log = tmp_path / "trainer.log"
    for kill in range(1, 11):  # right after step 1, 2, ... 10: inside or before the next step
        trainer = start_weightcast(cli_env, log, *args, "--consumer", "k")
        try:
            wait_for(
                lambda k=kill, t=trainer: (
                    t.poll() is not None or f" step step={k} " in current_run(log)
                ),
                300,
                f"step {kill}",
                every=0.02,
            )
            assert trainer.poll() is None, log.read_text()[-3000:]
        finally:
            trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=60) == -signal.SIGKILL

    last = start_weightcast(cli_env, log, *args, "--consumer", "k")
    assert last.wait(timeout=600) == 0, log.read_text()[-3000:]

    assert dead_letters(client, keys) == {}
    resume = tmp_path / "checkpoints-resume"
    assert final_train_state(resume).applied_ids() == produced
    model = checkpoint_model(resume / f"step-{count}")
    reference = checkpoint_model(tmp_path / "reference" / "checkpoints-resume" / f"step-{count}")
    assert model.keys() == reference.keys() and model
    for name in model:
        assert torch.equal(model[name], reference[name]), f"{name} differs"
    assert client.hlen(keys.trainer_attempts) == 0 and client.hlen(keys.trainer_running) == 0


def test_a_batch_that_kills_the_trainer_every_time_is_dead_lettered_and_its_step_mate_trained(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The poison batch shares a step (two micro-batches) with a good one. The step's batches
    are retried alone: the good one trains, the poison one kills the trainer on each of its
    ``max_attempts`` attempts (as a segfault or the OOM killer would), then is refused."""
    env = {**with_test_modules(cli_env), "WEIGHTCAST_TRAINER_MAX_ATTEMPTS": "3"}
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    good = list(push_batches(url, keys, 3, prefix="a"))  # step 1, and the poison's step mate
    poison = push_raw(client, keys, a_batch(7), poison="kill")
    good += push_batches(url, keys, 4, prefix="b", seed=1)
    args = ("trainer", "--loss", "poison_loss:loss", "--micro-batches", "2", "--steps", "4")
    log = tmp_path / "trainer.log"
    codes = []
    while not codes or codes[-1] != 0:
        assert len(codes) < 6, f"still failing after {codes}:\n{log.read_text()[-3000:]}"
        trainer = start_weightcast(env, log, *args, "--publish-every", "100")
        codes.append(trainer.wait(timeout=600))

    assert codes == [-signal.SIGKILL] * 3 + [0], log.read_text()[-3000:]
    assert list(dead_letters(client, keys)) == [poison]
    reason = dead_letters(client, keys)[poison]
    assert reason.startswith("failed 3 attempts (trainer.max_attempts=3)"), reason
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert sorted(state.applied_ids()) == sorted(good)  # each once, the step mate included
    assert client.hlen(keys.trainer_attempts) == 0


def test_entries_that_cannot_be_decoded_are_dead_lettered_at_once_not_crashed_on(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Meta JSON nested 100,000 deep (RecursionError in the parser) and a 5000-digit
    policy_version (ValueError): invalid batches, refused on the first try."""
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    good = list(push_batches(url, keys, 2))
    valid = push_raw(client, keys, a_batch(1))
    deep = client.xadd(
        keys.batches, {"batch": save(a_batch(2)), "meta": "[" * 100_000 + "]" * 100_000}
    ).decode()
    long_number = client.xadd(
        keys.batches,
        {"batch": b"x", "meta": '{"policy_version": ' + "9" * 5000 + ', "producer": "p"}'},
    ).decode()
    good += push_batches(url, keys, 2, prefix="c", seed=1)

    result = run_weightcast(cli_env, "trainer", "--steps", "5", "--publish-every", "100")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("trainer started") == 1
    reasons = dead_letters(client, keys)
    assert list(reasons) == [deep, long_number]
    assert reasons[deep].startswith("entry cannot be decoded: RecursionError"), reasons[deep]
    assert reasons[long_number].startswith("entry cannot be decoded: ValueError"), reasons
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert state.applied_ids() == [*good[:2], valid, *good[2:]]
