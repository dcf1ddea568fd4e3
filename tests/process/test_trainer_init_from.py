"""``--init-from``: the trainer starts from a real ``save_pretrained`` checkpoint, its first
version is that checkpoint bit for bit, and a resumed run never reloads it.

Every checkpoint here is written by ``transformers`` itself (:func:`save_pretrained_qwen3`):
sharded and not, tied and untied, bf16, fp16 and fp32, dense and mixtures of experts (one
tensor per expert), in shapes no flavor has.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis
import torch

from weightcast.contract.keys import Keys

from helpers.models import HF_SHAPES, checkpoint_tensors, save_pretrained_qwen3
from helpers.processes import (
    config_file,
    run_torchrun_trainer,
    run_weightcast,
    start_weightcast,
    stop,
    wait_for,
    with_namespace,
)
from helpers.redis_state import heartbeat, push_batches
from helpers.snapshots import checkpoint_model


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: equal bytes, not just equal values (-0.0 is not 0.0)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_the_start(tensors: dict[str, torch.Tensor], start: Path) -> None:
    """``tensors`` (bf16) are the checkpoint's, cast to bf16, byte for byte."""
    expected = checkpoint_tensors(start)
    assert tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensors[name].dtype == torch.bfloat16, name
        assert torch.equal(raw(tensors[name]), raw(tensor.to(torch.bfloat16))), name


def version_tensors(client: redis.Redis, keys: Keys, weights: Path, version: int) -> dict:
    step = int(client.hget(keys.version(version), "step"))
    return {"step": step, "tensors": checkpoint_tensors(weights / f"v{version}")}


@pytest.mark.parametrize(
    ("shape", "dtype", "shard_kb"),
    [
        ("tied-odd", torch.bfloat16, None),
        ("untied-odd", torch.float32, 150),
        ("tied-odd", torch.float16, 60),
        ("moe-untied-odd", torch.float32, 100),
        ("moe-tied-odd", torch.bfloat16, None),
    ],
    ids=[
        "tied-bf16-one-file",
        "untied-fp32-sharded",
        "tied-fp16-sharded",
        "moe-untied-fp32-sharded",
        "moe-tied-bf16-one-file",
    ],
)
def test_a_fresh_run_starts_from_the_checkpoint_and_publishes_it_first(
    cli_env: dict[str, str],
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    shape: str,
    dtype: torch.dtype,
    shard_kb: int | None,
) -> None:
    """The first version (step 0) is the checkpoint cast to bf16, bitwise, through
    ``--layout hf``; the next one is trained from it."""
    start = save_pretrained_qwen3(tmp_path / "start", shape, dtype, shard_kb)
    if shard_kb:
        assert (start / "model.safetensors.index.json").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    publisher = start_weightcast(
        cli_env, logs / "publisher.log", "publisher", "--layout", "hf", "--rescan-seconds", "0.2"
    )
    trainer = start_weightcast(
        cli_env,
        logs / "trainer.log",
        "trainer",
        "--init-from",
        str(start),
        "--steps",
        "2",
        "--publish-every",
        "2",
        "--lr",
        "1e-2",
    )
    try:
        wait_for(lambda: client.get(keys.latest) == b"1", 300, "the start published as v1")
        first = version_tensors(client, keys, tmp_path / "weights", 1)
        assert first["step"] == 0
        assert_bitwise_the_start(first["tensors"], start)
        push_batches(
            cli_env["WEIGHTCAST_REDIS_URL"], keys, 2, vocab_size=HF_SHAPES[shape].shape.vocab_size
        )
        assert trainer.wait(timeout=300) == 0, (logs / "trainer.log").read_text()[-3000:]
        wait_for(lambda: client.get(keys.latest) == b"2", 300, "step 2 published as v2")
        trained = version_tensors(client, keys, tmp_path / "weights", 2)
        assert trained["step"] == 2
        assert trained["tensors"].keys() == first["tensors"].keys()
        assert any(
            not torch.equal(trained["tensors"][name], first["tensors"][name])
            for name in first["tensors"]
        ), "two steps at lr 1e-2 changed nothing"
    finally:
        stop(trainer)
        stop(publisher)
    log = (logs / "trainer.log").read_text()
    assert "started from a checkpoint" in log and "published the start" in log


@pytest.mark.parametrize("shape", ["untied-odd", "moe-untied-odd"])
def test_two_fsdp_ranks_start_from_the_checkpoint(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path, shape: str
) -> None:
    """Under FSDP each rank reads its own shards of the checkpoint (an MoE's experts: half
    of them each); the step-0 snapshot the two ranks write together is the checkpoint,
    bitwise, and the step-1 one holds the same tensors, trained."""
    start = save_pretrained_qwen3(tmp_path / "start", shape, torch.bfloat16, 150)
    push_batches(
        cli_env["WEIGHTCAST_REDIS_URL"], keys, 2, vocab_size=HF_SHAPES[shape].shape.vocab_size
    )
    result = run_torchrun_trainer(
        cli_env, 2, "--init-from", str(start), "--steps", "1", "--lr", "1e-2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first = snapshot_tensors(tmp_path / "checkpoints" / "step-0")
    assert_bitwise_the_start(first, start)
    trained = snapshot_tensors(tmp_path / "checkpoints" / "step-1")
    assert {n: t.shape for n, t in trained.items()} == {n: t.shape for n, t in first.items()}
    assert all(torch.isfinite(t.float()).all() for t in trained.values())
    moved = [name for name in first if not torch.equal(trained[name], first[name])]
    assert any(".mlp." in name for name in moved), "one step at lr 1e-2 left the MLPs alone"


def test_experts_that_do_not_split_over_the_fsdp_ranks_are_refused(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    """torchtitan's adapter names a rank's experts only when they split evenly: 5 experts
    over 2 ranks are refused with one line, before any snapshot."""
    start = save_pretrained_qwen3(tmp_path / "start", "moe-tied-odd", torch.bfloat16)
    result = run_torchrun_trainer(cli_env, 2, "--init-from", str(start), "--steps", "1")
    assert result.returncode != 0
    assert "the model's 5 experts do not split evenly over 2 FSDP ranks" in result.stderr
    assert not (tmp_path / "checkpoints" / "step-0").exists()


def snapshot_tensors(snapshot: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a trainer snapshot, read as the publisher reads it."""
    from weightcast.contract.snapshot_format import read_complete
    from weightcast_publisher.dcp_load import load_tensors
    from weightcast_publisher.snapshot_scan import Snapshot

    return load_tensors(Snapshot(snapshot, read_complete(snapshot)))


@pytest.mark.parametrize("shape", ["tied-odd", "moe-tied-odd"])
def test_a_resumed_run_never_reloads_its_start(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path, shape: str
) -> None:
    """SIGKILL after a resume checkpoint, then a restart with the checkpoint directory
    overwritten by other weights: the final model is bitwise an uninterrupted run's from the
    first start (the restart resumed; had it loaded the start again, it could not be)."""
    start = save_pretrained_qwen3(tmp_path / "start", shape, torch.bfloat16)
    every_two = config_file(tmp_path, "[trainer.checkpoint]\ninterval = 2\n")
    args = ("trainer", "--config", every_two, "--init-from", str(start), "--steps", "4")

    whole = with_namespace(cli_env, tmp_path, "whole")
    whole_keys = Keys(whole["WEIGHTCAST_NAMESPACE"])
    push_batches(whole["WEIGHTCAST_REDIS_URL"], whole_keys, 4, vocab_size=1000)
    result = run_weightcast(whole, *args, "--consumer", "c")
    assert result.returncode == 0, result.stderr[-3000:]
    uninterrupted = checkpoint_model(tmp_path / "whole" / "checkpoints-resume" / "step-4")

    url = cli_env["WEIGHTCAST_REDIS_URL"]
    push_batches(url, keys, 3, vocab_size=1000)  # step 4 waits for its batch
    log = tmp_path / "trainer.log"
    trainer = start_weightcast(cli_env, log, *args, "--consumer", "c")
    try:
        wait_for(
            lambda: (
                heartbeat(client, keys).get("checkpoint_step") == "2"
                and heartbeat(client, keys).get("step") == "3"
            ),
            300,
            "a resume checkpoint at step 2 and step 3 trained",
        )
    finally:
        assert stop(trainer, signal.SIGKILL) == -signal.SIGKILL
    save_pretrained_qwen3(start, shape, torch.bfloat16, seed=7)  # another start
    push_batches(url, keys, 1, vocab_size=1000, skip=3)  # the fourth of the same sequence
    restarted = run_weightcast(cli_env, *args, "--consumer", "c")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed" in restarted.stderr and "started from a checkpoint" not in restarted.stderr
    final = checkpoint_model(tmp_path / "checkpoints-resume" / "step-4")
    assert final.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(raw(final[name]), raw(tensor)), name
