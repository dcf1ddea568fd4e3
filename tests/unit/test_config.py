"""Configuration layers: defaults < TOML file < WEIGHTCAST_* environment < command line."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from weightcast.cli.main import build_parser, main
from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import Config
from weightcast.runtime.settings import (
    env_var,
    flag_overrides,
    load_config,
    reference_markdown,
    settings,
)
from weightcast.store.settings import StoreSettings

from helpers.files import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "weightcast.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(env={})
    assert config.common.namespace == "wc"
    assert config.publisher.tp == 1 and config.publisher.keep == 2
    assert config.trainer.model == "tiny"


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'namespace = "from-file"\nredis_url = "redis://file:1/0"\n'
        "[trainer]\npublish_every = 3\nsteps = 7\n[publisher]\ntp = 2\n",
    )
    env = {"WEIGHTCAST_NAMESPACE": "from-env", "WEIGHTCAST_TRAINER_PUBLISH_EVERY": "5"}
    args = build_parser().parse_args(["trainer", "--publish-every", "9"])
    config = load_config(path, env=env, overrides=flag_overrides(args))
    assert config.common.redis_url == "redis://file:1/0"  # file only
    assert config.common.namespace == "from-env"  # env beats file
    assert config.trainer.publish_every == 9  # flag beats env and file
    assert config.trainer.steps == 7 and config.publisher.tp == 2


def test_absent_flags_do_not_reset_lower_layers() -> None:
    args = build_parser().parse_args(["publisher"])
    config = load_config(env={"WEIGHTCAST_PUBLISHER_TP": "4"}, overrides=flag_overrides(args))
    assert config.publisher.tp == 4


def test_env_names_follow_the_dotted_setting() -> None:
    assert env_var("redis_url") == "WEIGHTCAST_REDIS_URL"
    assert env_var("publisher.rescan_seconds") == "WEIGHTCAST_PUBLISHER_RESCAN_SECONDS"


def test_booleans_and_paths_are_parsed(tmp_path: Path) -> None:
    config = load_config(
        env={"WEIGHTCAST_PUBLISHER_POLL": "yes", "WEIGHTCAST_WEIGHTS_DIR": str(tmp_path)}
    )
    assert config.publisher.poll is True
    assert config.common.weights_dir == tmp_path


def test_torchtitan_sections_are_kept_for_the_trainer(tmp_path: Path) -> None:
    path = write(
        tmp_path, "[trainer.optimizer]\nlr = 1e-5\n[trainer.lr_scheduler]\nwarmup_steps = 3\n"
    )
    config = load_config(path, env={})
    assert config.trainer.titan == {"optimizer": {"lr": 1e-5}, "lr_scheduler": {"warmup_steps": 3}}


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("stepz = 1\n", {}, "unknown setting 'stepz'"),
        ("[publisher]\ntpp = 2\n", {}, "unknown setting 'publisher.tpp'"),
        ("[publisher]\ntp = 1.5\n", {}, "publisher.tp: not an integer"),
        ("", {"WEIGHTCAST_PUBLISHER_KEEP": "two"}, "$WEIGHTCAST_PUBLISHER_KEEP"),
        ("", {"WEIGHTCAST_PUBLISHER_POLL": "maybe"}, "not a boolean"),
        ("[trainer\n", {}, "cannot read config file"),
    ],
)
def test_bad_settings_name_their_source(tmp_path: Path, text: str, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text), env=env)
    assert message in str(error.value)


def test_the_readme_example_is_a_valid_config(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    config = load_config(write(tmp_path, example), env={})
    assert config.trainer.model == "0.6B" and config.publisher.tp == 2
    assert config.trainer.lr == 1e-6 and config.trainer.titan == {}


def test_the_configuration_reference_is_current() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == reference_markdown(), "run: python scripts/gen_config_docs.py"
    for item in settings().values():
        assert f"| `{item.name}` |" in page


BAD_SETTINGS = [
    (["trainer", "--steps", "-5"], "trainer.steps (from --steps) must be >= 0, got -5"),
    (["trainer", "--model", "nope"], "trainer.model (from --model) must be one of tiny, small"),
    (["trainer", "--seq-len", "0"], "trainer.seq_len (from --seq-len) must be >= 2, got 0"),
    (["trainer", "--kl-coef", "1e6"], "trainer.kl_coef (from --kl-coef) must be <= 10, got"),
    (
        ["publisher", "--keep-records", "3"],
        "publisher.keep_records (from --keep-records) must be >= 10",
    ),
    (["publisher", "--keep", "0"], "publisher.keep (from --keep) must be >= 1, got 0"),
    (["publisher", "--keep", "-1"], "publisher.keep (from --keep) must be >= 1, got -1"),
    (["publisher", "--tp", "3"], "publisher.tp (from --tp) must be a power of two; got 3"),
    (["status", "--namespace", "a b"], "namespace (from --namespace) must be 1-64 letters"),
    (["status", "--namespace", "{wc}"], "namespace (from --namespace) must be 1-64 letters"),
    (["status", "--log-format", "xml"], "log_format (from --log-format) must be one of text"),
    (["status", "--redis-url", "http://x:1"], "must be a redis://, rediss:// or unix:// URL"),
    (["follow", "--poll-seconds", "0"], "follow.poll_seconds (from --poll-seconds) must be > 0"),
    (["up", "--store", "nfs"], "up.store (from --store) must be one of directory, s3"),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS]
)
def test_a_setting_out_of_bounds_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    for name in [n for n in os.environ if n.startswith("WEIGHTCAST_")]:
        monkeypatch.delenv(name)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weightcast {argv[0]}: configuration error: ")
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_a_checkpoint_dir_that_cannot_be_written_is_a_configuration_error(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "checkpoints"
    if kind == "a file":
        target.write_text("not a directory")
        expected = f"checkpoint_dir {target} is not a directory"
    else:
        target = Path("/proc/weightcast-checkpoints")  # a filesystem nobody may create in
        expected = f"checkpoint_dir {target} is not writable"
    assert main(["publisher", "--checkpoint-dir", str(target), "--once"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_each_section_is_declared_by_the_role_that_reads_it() -> None:
    """Each role's settings live beside its code; runtime.config composes them (and keeps
    what every process reads, with the object store's part of the top level)."""
    homes = {
        f.name: f.default_factory.__module__  # type: ignore[misc]
        for f in dataclasses.fields(Config)
        if f.name != "sources"
    }
    assert homes == {
        "common": "weightcast.runtime.config",
        "up": "weightcast.local.settings",
        "trainer": "weightcast_trainer.settings",
        "publisher": "weightcast_publisher.settings",
        "produce": "weightcast.local.settings",
        "follow": "weightcast.client.settings",
        "rollout": "weightcast.local.settings",
    }
    store = {f.name for f in dataclasses.fields(StoreSettings)}
    assert {"weights_url", "s3_addressing_style"} <= store
    assert store <= {n for n, item in settings().items() if item.section == "common"}
