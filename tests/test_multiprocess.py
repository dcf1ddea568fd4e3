"""``torchrun -m trainer`` with two CPU processes over gloo (torchtitan's FSDP)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from shared.keys import TRAINER_GROUP, Keys
from shared.manifest import Manifest, verify_files
from shared.snapshots import SnapshotInfo

from helpers import run_torchrun_trainer, run_weightcast

pytestmark = pytest.mark.slow


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
    assert sorted(p.name for p in snapshot.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    run_id = SnapshotInfo.read(snapshot).run_id
    assert client.hget(keys.trainer_heartbeat, "run_id").decode() == run_id

    published = run_weightcast(cli_env, "publisher", "--once")
    assert published.returncode == 0, published.stderr
    version_dir = tmp_path / "weights" / "v1"
    manifest = Manifest.read(version_dir)
    verify_files(version_dir, manifest)
    assert (manifest.step, manifest.run_id) == (2, run_id)
