"""What the trainer computes and writes: accumulated steps, FSDP snapshots, example configs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.producer import BatchProducer
from weightcast.contract.keys import Keys
from weightcast.contract.snapshot_format import read_complete
from weightcast.runtime.settings import load_config
from weightcast_publisher.dcp_load import load_tensors
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast_trainer.job import build_job_config
from weightcast_trainer.model import TRAIN_SPEC_NAME
from weightcast_trainer.resume import resume_dir

from helpers.files import REPO
from helpers.processes import (
    config_file,
    run_torchrun_trainer,
    run_weightcast,
    with_namespace,
    with_test_modules,
)
from helpers.redis_state import push_batches
from helpers.snapshots import checkpoint_model, final_train_state

EXAMPLES = REPO / "examples"


def rollout(generator: torch.Generator, rows: int, trained: int) -> dict[str, torch.Tensor]:
    """``rows`` sequences of 16 tokens whose last ``trained`` tokens are the response."""
    mask = torch.zeros(rows, 16, dtype=torch.bool)
    mask[:, 16 - trained :] = True
    return {
        "input_ids": torch.randint(0, 1024, (rows, 16), generator=generator),
        "loss_mask": mask,
        "advantages": torch.randn(rows, generator=generator),
        "old_logprobs": -5 - torch.rand(rows, 16, generator=generator),
    }


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes: equal bytes, not just equal values (-0.0 is not 0.0)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_micro_batches_accumulate_into_the_update_of_one_big_batch(
    cli_env: dict[str, str], client: redis.Redis, tmp_path: Path
) -> None:
    generator = torch.Generator().manual_seed(0)
    # Different lengths: 2 x 12 and 3 x 3 trained tokens, so equal weights would be wrong.
    small = [rollout(generator, 2, 12), rollout(generator, 3, 3)]
    big = {name: torch.cat([b[name] for b in small]) for name in small[0]}
    # eps = lr makes AdamW's first update proportional to the gradient, not just its sign.
    config = tmp_path / "linear.toml"
    config.write_text(
        "[trainer]\nlr = 10.0\n[trainer.optimizer]\neps = 10.0\nweight_decay = 0.0\n"
        "[trainer.training]\nmax_norm = 1e9\n"
    )
    results = {}
    for name, batches, micro in (("accumulated", small, "2"), ("one", [big], "1")):
        env = with_namespace(cli_env, tmp_path, name)
        producer = BatchProducer(
            env["WEIGHTCAST_REDIS_URL"], env["WEIGHTCAST_NAMESPACE"], max_pending=0
        )
        for tensors in batches:
            producer.push(tensors, 0)
        result = run_weightcast(
            env, "trainer", "--config", str(config), "--micro-batches", micro, "--steps", "1"
        )
        assert result.returncode == 0, result.stderr[-3000:]
        state = final_train_state(tmp_path / name / "checkpoints-resume")
        assert (state.step, len(state.applied_ids())) == (1, len(batches))
        results[name] = checkpoint_model(tmp_path / name / "checkpoints-resume" / "step-1")

    accumulated, one = results["accumulated"], results["one"]
    assert accumulated.keys() == one.keys() and accumulated
    for key in one:
        torch.testing.assert_close(accumulated[key], one[key], rtol=1e-4, atol=1e-6)


def test_an_fsdp_snapshot_holds_the_same_tensors_as_a_single_process_one(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """The trainer's side of FSDP: two ranks snapshot exactly the weights one process does.
    That the publisher turns a snapshot of two ranks' files into the same bytes as one of a
    single file is tests/integration/test_converter.py's
    ``test_a_snapshot_written_by_two_fsdp_ranks_converts_to_the_same_bytes``."""
    push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 1)
    single = run_weightcast(cli_env, "trainer", "--steps", "1")
    assert single.returncode == 0, single.stderr[-3000:]

    # Two ranks resume the same weights (resharded by DCP) and snapshot them with FSDP.
    fsdp_env = with_namespace(cli_env, tmp_path, "fsdp")
    shutil.copytree(tmp_path / "checkpoints-resume", tmp_path / "fsdp" / "checkpoints-resume")
    ranks = run_torchrun_trainer(fsdp_env, 2, "--steps", "1")
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    snapshots = [tmp_path / "checkpoints" / "step-1", tmp_path / "fsdp" / "checkpoints" / "step-1"]
    assert sorted(p.name for p in snapshots[1].glob("*.safetensors")) == [  # one file per rank
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]

    one, two = (load_tensors(Snapshot(path, read_complete(path))) for path in snapshots)
    assert one.keys() == two.keys() and one
    for name, tensor in one.items():
        assert tensor.dtype == two[name].dtype and torch.equal(raw(tensor), raw(two[name])), name
    configs = [(path / "config.json").read_bytes() for path in snapshots]
    assert configs[0] == configs[1]


@pytest.mark.parametrize("example", ["tiny-cpu.toml", "qwen3-0.6b-gpu.toml"])
def test_example_configs_load_and_build_a_torchtitan_job(example: str) -> None:
    config = load_config(EXAMPLES / example, env={})
    job = build_job_config(config.trainer, resume_dir(config))
    assert job.model.name == TRAIN_SPEC_NAME
    assert job.model.flavor == {"tiny-cpu.toml": "tiny", "qwen3-0.6b-gpu.toml": "0.6B"}[example]
    assert job.checkpoint.enable and job.checkpoint.keep_latest_k == 2
    assert Path(job.checkpoint.folder).is_absolute()
    assert job.training.seq_len == config.trainer.seq_len
    assert config.trainer.lr == job.optimizer.lr


def test_a_loss_that_cannot_be_loaded_is_a_configuration_error(cli_env: dict[str, str]) -> None:
    result = run_weightcast(cli_env, "trainer", "--loss", "no_such_package_xyz:loss")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.loss: cannot load loss 'no_such_package_xyz:loss'" in result.stderr


def test_garbage_is_collected_every_gc_freq_steps(
    cli_env: dict[str, str], keys: Keys, tmp_path: Path
) -> None:
    """torchtitan's engine turns Python's automatic GC off; the trainer must collect every
    ``training.gc_freq`` steps itself (steps 2 and 4 of 5 at gc_freq 2), or cycles that hold
    pinned or device memory live for the whole run."""
    push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 5)
    record = tmp_path / "gc.log"
    config = config_file(
        tmp_path, "[trainer]\npublish_every = 100\n[trainer.training]\ngc_freq = 2\n"
    )
    env = with_test_modules({**cli_env, "WEIGHTCAST_TEST_GC_LOG": str(record)})
    result = run_weightcast(
        env, "trainer", "--config", config, "--loss", "gc_probe_loss:loss", "--steps", "5"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Collections (generation 1 or 2: torchtitan's) in each gap between two loss calls.
    gaps, count = [], 0
    for line in record.read_text().splitlines():
        if line == "loss":
            gaps.append(count)
            count = 0
        elif line in ("gc 1", "gc 2"):
            count += 1
    assert len(gaps) == 5
    assert gaps[1:] == [1, 0, 1, 0]  # before steps 2 and 4
