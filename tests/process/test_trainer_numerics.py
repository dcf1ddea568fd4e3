"""Numerically safe training through the real trainer and publisher processes.

Batches with extreme but finite values must neither make the policy NaN nor get NaN weights
published; a step whose loss is not finite anyway (a user's loss) is not applied at all.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
from pathlib import Path

import redis
import torch
from safetensors.torch import load_file

from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_FILE_SUFFIX
from weightcast.local.produce import synthetic_batch

from helpers.files import REPO
from helpers.processes import (
    run_weightcast,
    wait_for,
    weightcast,
    with_namespace,
    with_test_modules,
)
from helpers.redis_state import dead_letters, heartbeat, push_batches, push_raw
from helpers.snapshots import checkpoint_model, final_train_state


def extreme(seed: int, **overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    tensors = synthetic_batch(torch.Generator().manual_seed(seed), 2, 16, 1024)
    return {**tensors, **overrides}


def step_losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"\bstep step=\d+ loss=(\S+)", text)]


def test_extreme_batches_neither_make_the_policy_nan_nor_publish_nan_weights(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """old_logprobs of -100 and -1e4 with negative advantages (the ratio overflows), and
    advantages of 3e38 (the product overflows), between good batches."""
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    negative = torch.full((2,), -1.0)
    trained = list(push_batches(url, keys, 2, prefix="good-a"))
    trained.append(
        push_raw(
            client, keys, extreme(1, old_logprobs=torch.full((2, 16), -100.0), advantages=negative)
        )
    )
    trained += push_batches(url, keys, 1, prefix="good-b", seed=1)
    trained.append(
        push_raw(
            client, keys, extreme(2, old_logprobs=torch.full((2, 16), -1e4), advantages=negative)
        )
    )
    huge = push_raw(
        client,
        keys,
        extreme(3, old_logprobs=torch.full((2, 16), -7.0), advantages=torch.full((2,), 3e38)),
    )
    trained += push_batches(url, keys, 3, prefix="good-c", seed=2)
    steps = len(trained)

    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "publisher.log", "wb") as out:
        publisher = subprocess.Popen(
            weightcast("publisher", "--rescan-seconds", "0.5", "--keep", "100"),
            env=cli_env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        result = run_weightcast(
            cli_env, "trainer", "--steps", str(steps), "--publish-every", "2", "--consumer", "n"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        wait_for(
            lambda: (
                client.get(keys.latest)
                and client.hget(keys.version(int(client.get(keys.latest))), "step")
                == str(steps).encode()
            ),
            120,
            "the last snapshot published",
        )
    finally:
        publisher.send_signal(signal.SIGTERM)
        publisher.wait(timeout=60)

    # Every step's loss was finite, and every published version holds finite weights.
    losses = step_losses(result.stderr)
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), losses
    versions = sorted((tmp_path / "weights").glob("v*"))
    assert versions
    for version in versions:
        files = [p for p in version.rglob("*") if p.suffix in (".safetensors", FUSED_FILE_SUFFIX)]
        assert files, version
        for file in files:
            for name, tensor in load_file(str(file)).items():
                assert torch.isfinite(tensor.float()).all(), f"{file}: {name} is not finite"
    for name, tensor in checkpoint_model(tmp_path / "checkpoints-resume" / f"step-{steps}").items():
        assert torch.isfinite(tensor.float()).all(), f"resume checkpoint: {name} is not finite"

    # The good batches and the admissible extreme ones trained; 3e38 is refused with a reason.
    assert final_train_state(tmp_path / "checkpoints-resume").applied_ids() == trained
    reasons = dead_letters(client, keys)
    assert list(reasons) == [huge]
    assert "advantages holds 3e+38, beyond the bound of +-10000" in reasons[huge]
    beat = heartbeat(client, keys)
    assert math.isfinite(float(beat["loss"])) and math.isfinite(float(beat["grad_norm"]))
    assert beat["skipped_steps"] == "0"


def test_a_step_with_a_non_finite_loss_is_not_applied_and_training_goes_on(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """A user's loss turns NaN on one batch: that step leaves weights, optimizer and LR
    schedule untouched, so the final model is bit for bit the one of a run without it."""
    runs = {}
    for name, with_poison in (("poisoned", True), ("clean", False)):
        env = with_namespace(with_test_modules(cli_env), tmp_path, name)
        run_keys = Keys(env["WEIGHTCAST_NAMESPACE"])
        url = env["WEIGHTCAST_REDIS_URL"]
        good = list(push_batches(url, run_keys, 2, prefix="a"))
        poison = push_raw(client, run_keys, extreme(5), poison="nan") if with_poison else None
        good += push_batches(url, run_keys, 2, prefix="b", seed=1)
        result = run_weightcast(
            env, "trainer", "--loss", "poison_loss:loss", "--steps", "4", "--publish-every", "100"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        resume = tmp_path / name / "checkpoints-resume"
        assert final_train_state(resume).applied_ids() == good
        runs[name] = (checkpoint_model(resume / "step-4"), result.stderr, run_keys, poison)

    poisoned, text, run_keys, poison = runs["poisoned"]
    clean, clean_text, _, _ = runs["clean"]
    assert poisoned.keys() == clean.keys() and poisoned
    for name in clean:
        assert torch.equal(poisoned[name], clean[name]), f"{name} differs from the clean run"
    assert re.findall(r" lr=(\S+)", text) == re.findall(r" lr=(\S+)", clean_text)
    assert "step skipped: its loss or gradient norm was not finite" in text
    (reason,) = dead_letters(client, run_keys).values()
    assert "its loss was not finite in step 3" in reason
    assert list(dead_letters(client, run_keys)) == [poison]
    beat = heartbeat(client, run_keys)
    assert (beat["skipped_steps"], beat["step"], beat["dead_lettered"]) == ("1", "4", "1")
