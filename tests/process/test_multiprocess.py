"""``torchrun -m weightcast.trainer`` with two CPU processes over gloo (torchtitan's FSDP)."""

from __future__ import annotations

import re
from pathlib import Path

import redis

from weightcast.contract.keys import TRAINER_GROUP, Keys
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.snapshots import SnapshotInfo

from helpers import final_train_state, push_batches, run_torchrun_trainer, run_weightcast


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
