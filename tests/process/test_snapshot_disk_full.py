"""The real trainer with its snapshot directory on a full filesystem: every snapshot is
skipped and counted in the heartbeat, training goes on and ends normally, nothing partial."""

from __future__ import annotations

from pathlib import Path

import redis

from weightcast.contract.keys import Keys

from helpers.files import tmpfs
from helpers.processes import run_weightcast
from helpers.redis_state import push_batches
from helpers.snapshots import final_train_state


def test_a_full_snapshot_filesystem_skips_snapshots_and_training_goes_on(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    # 16 KiB: no snapshot fits. The resume checkpoints live beside it, on the real disk.
    with tmpfs(tmp_path / "checkpoints", "16k") as checkpoints:
        push_batches(cli_env["WEIGHTCAST_REDIS_URL"], keys, 3)
        result = run_weightcast(cli_env, "trainer", "--steps", "3", "--publish-every", "1")
        assert result.returncode == 0, result.stderr[-3000:]
        no_space = result.stderr.count("snapshot skipped: no space left")
        beat = client.hgetall(keys.trainer_heartbeat)
        heartbeat = {k.decode(): v.decode() for k, v in beat.items()}
        # Steps 1, 2 and 3 each tried a snapshot: it failed for want of space, or, when the
        # step came before the previous write had failed, was skipped as still running.
        assert no_space >= 1
        assert no_space + int(heartbeat["publish_skipped"]) == 3
        assert heartbeat["snapshots_skipped_no_space"] == str(no_space)
        assert heartbeat["snapshots_written"] == "0"
        assert list(checkpoints.iterdir()) == []  # no step-N, no .tmp-step-N
        assert final_train_state(tmp_path / "checkpoints-resume").step == 3
