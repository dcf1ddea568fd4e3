"""``torchrun -m weightcast_trainer`` with two CPU processes over gloo (torchtitan's FSDP)."""

from __future__ import annotations

import re
from pathlib import Path

import redis
import torch

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast.local.produce import synthetic_batch

from helpers.processes import run_torchrun_trainer, run_weightcast, with_test_modules
from helpers.redis_state import dead_letters, heartbeat, push_batches, push_raw
from helpers.snapshots import checkpoint_model, final_train_state


def test_two_ranks_train_their_own_batches_and_write_one_snapshot(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    assert run_weightcast(cli_env, "produce", "--count", "4").returncode == 0
    result = run_torchrun_trainer(cli_env, 2, "--steps", "2", "--publish-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]

    # Each rank trained two batches of its own: all four consumed and acknowledged.
    consumers = {c["name"].decode(): c for c in client.xinfo_consumers(keys.batches, TRAINER_GROUP)}
    assert len(consumers) == 2 and all(name.endswith(("-dp0", "-dp1")) for name in consumers)
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
    assert client.xinfo_groups(keys.batches)[0]["lag"] == 0

    # One snapshot, written by both ranks, with one run id.
    snapshot = tmp_path / "checkpoints" / "step-2"
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == [  # one file per rank
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    run_id = SnapshotInfo.read(snapshot).run_id
    assert client.hget(keys.trainer_heartbeat, "run_id").decode() == run_id

    published = run_weightcast(cli_env, "publisher", "--once")
    assert published.returncode == 0, published.stderr
    version_dir = tmp_path / "weights" / "v1"
    manifest = Manifest.read(version_dir)
    verify_files(version_dir, manifest)
    assert (manifest.step, manifest.run_id) == (2, run_id)


def test_two_ranks_with_async_resume_checkpoints_ack_each_entry_once_checkpointed(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    produced = push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 12)
    config = tmp_path / "trainer.toml"
    config.write_text('[trainer.checkpoint]\ninterval = 1\nasync_mode = "async"\n')
    result = run_torchrun_trainer(
        cli_env, 2, "--config", str(config), "--steps", "6", "--publish-every", "100"
    )
    assert result.returncode == 0, result.stderr[-3000:]

    # Five checkpoints were written while the ranks trained on, then the last one at exit.
    assert result.stderr.count("resume checkpoint started") == 2 * 6
    acked = [int(n) for n in re.findall(r"resume checkpoint step=\d+ acked=(\d+)", result.stderr)]
    assert acked == [1] * 12  # per rank and checkpoint: its own entry of that step
    resume_dir = tmp_path / "checkpoints-resume"
    state = final_train_state(resume_dir)
    assert state.step == 6 and sorted(state.applied_ids()) == sorted(produced)
    assert sorted(p.name for p in (resume_dir / "step-6").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
    assert client.xlen(keys.batches) == 0


def test_two_ranks_skip_a_non_finite_step_together_and_train_on(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """One rank's loss turns NaN (a user's loss): both ranks drop that step, the batch at
    fault is dead-lettered, the other rank's batch of that step is trained later."""
    url = cli_env["WEIGHTCAST_REDIS_URL"]
    good = list(push_batches(url, keys, 3, prefix="a"))
    poison = push_raw(client, keys, synthetic_batch(torch.Generator(), 2, 16, 1024), poison="nan")
    good += push_batches(url, keys, 3, prefix="b", seed=1)
    env = with_test_modules(cli_env)
    result = run_torchrun_trainer(
        env, 2, "--loss", "poison_loss:loss", "--steps", "3", "--publish-every", "100"
    )
    assert result.returncode == 0, result.stderr[-3000:]

    assert result.stderr.count("step skipped: its loss or gradient norm was not finite") == 2
    assert list(dead_letters(client, keys)) == [poison]
    state = final_train_state(tmp_path / "checkpoints-resume")
    assert (state.step, sorted(state.applied_ids())) == (3, sorted(good))
    for name, tensor in checkpoint_model(tmp_path / "checkpoints-resume" / "step-3").items():
        assert torch.isfinite(tensor).all(), name
    assert heartbeat(client, keys)["skipped_steps"] == "1"  # rank 0 reports for both
    assert client.xpending(keys.batches, TRAINER_GROUP)["pending"] == 0
