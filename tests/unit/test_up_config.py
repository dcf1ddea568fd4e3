"""``weightcast up``'s run config: its trainer defaults under the user's ``--config`` file."""

from __future__ import annotations

from pathlib import Path

from weightcast.local.up import TRAINER_DEFAULTS, write_run_config
from weightcast.runtime.config import load_config


def test_up_defaults_apply_unless_the_users_file_says_otherwise(tmp_path: Path) -> None:
    default = load_config(write_run_config(tmp_path, None), env={})
    assert (
        default.trainer.titan["optimizer"]["lr"] == TRAINER_DEFAULTS["trainer"]["optimizer"]["lr"]
    )

    user = tmp_path / "user.toml"
    user.write_text(
        'namespace = "mine"\n[trainer]\nseq_len = 128\n[trainer.optimizer]\nlr = 0.5\n'
        'name = "AdamW"\n[rollout]\ngroup_size = 4\n'
    )
    (tmp_path / "run").mkdir()
    merged = load_config(write_run_config(tmp_path / "run", user), env={})
    assert merged.common.namespace == "mine" and merged.trainer.seq_len == 128
    assert merged.trainer.titan["optimizer"] == {"lr": 0.5, "name": "AdamW"}
    assert merged.rollout.group_size == 4
