"""How settings are loaded, checked, offered as flags and documented.

Layers, lowest first: defaults < TOML file < ``WEIGHTCAST_*`` environment < command line.
From each setting's one declaration (each role declares its section beside its code;
:mod:`weightcast.runtime.config` composes them) come the flags of
every command (:func:`add_flags`), the bounds check (:func:`validate`, run by
:func:`load_config` on the merged result) and the reference page ``docs/configuration.md``
(:func:`reference_markdown`; a test fails when the page is stale).

A setting's environment variable is its dotted name in upper case with ``_`` for ``.``,
prefixed with ``WEIGHTCAST_``: ``WEIGHTCAST_REDIS_URL``, ``WEIGHTCAST_TRAINER_PUBLISH_EVERY``.

Why not a library (issue 38, item 4). pydantic-settings merges its sources (init, env, a TOML
file) into one dict before it validates, so a value out of bounds is reported without the
variable, file or flag it came from (``trainer.publish_every  Input should be greater than
or equal to 1 [input_value='0']``, tried with pydantic-settings 2.16): the one-line errors
naming the source would need one validation per layer, the layering again. Its command
line names flags by path (``--trainer.publish_every``) unless each is aliased, and it would
add pydantic to the core install. tyro (torchtitan's) builds only the command line, from the
same dataclasses (``--publish-every`` per command with ``OmitArgPrefixes``): the file and
environment layers, their provenance and the bounds would stay here, and it would become a
core dependency for the ~25 lines of :func:`add_flags`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import SECTION_COMMANDS, Config
from weightcast.runtime.spec import Spec

ENV_PREFIX = "WEIGHTCAST_"

SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in ("common", "sources"))
"""The TOML tables of weightcast's own sections."""


@dataclass(frozen=True)
class Setting:
    """One declared setting: its dotted name, section, type, default and :class:`Spec`."""

    name: str
    section: str
    key: str
    kind: type
    default: Any
    spec: Spec

    @property
    def env_var(self) -> str:
        return env_var(self.name)

    @property
    def commands(self) -> tuple[str, ...]:
        return self.spec.commands or SECTION_COMMANDS[self.section]


def settings() -> dict[str, Setting]:
    """Every setting by dotted name, in declaration order."""
    found: dict[str, Setting] = {}
    for section in dataclasses.fields(Config):
        if section.name == "sources":
            continue
        cls = section.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for fld in dataclasses.fields(cls):
            name = fld.name if section.name == "common" else f"{section.name}.{fld.name}"
            kind = typing.get_origin(hints[fld.name]) or hints[fld.name]
            default = getattr(defaults, fld.name)
            found[name] = Setting(name, section.name, fld.name, kind, default, fld.metadata["spec"])
    return found


def load_config(
    path: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration from its layers and check every bound; raises ConfigError."""
    config = Config()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        _apply_toml(config, table, str(path))
    env = os.environ if env is None else env
    known = settings()
    for item in known.values():
        if item.env_var in env:
            source = f"${item.env_var}"
            _set(config, item, _coerce(env[item.env_var], item.kind, source), source)
    for name, value in (overrides or {}).items():
        if value is not None:
            item = known[name]
            _set(config, item, value, config.sources.get(name) or item.spec.flag or name)
    validate(config)
    return config


def validate(config: Config) -> None:
    """Check every setting against its bounds; the first breach is a :class:`ConfigError`."""
    for name, item in settings().items():
        value = getattr(getattr(config, item.section), item.key)
        problem = _breach(item, value)
        if problem:
            source = config.sources.get(name)
            where = f" (from {source})" if source else ""
            raise ConfigError(f"{name}{where} {problem}")


def _breach(item: Setting, value: Any) -> str:
    """What is wrong with ``value`` for ``item``, or ''."""
    spec = item.spec
    if spec.ge is not None and value < spec.ge:
        return f"must be >= {spec.ge:g}, got {value!r}"
    if spec.gt is not None and value <= spec.gt:
        return f"must be > {spec.gt:g}, got {value!r}"
    if spec.le is not None and value > spec.le:
        return f"must be <= {spec.le:g}, got {value!r}"
    if spec.choices and value not in spec.choices:
        return f"must be one of {', '.join(spec.choices)}; got {value!r}"
    if spec.pattern and not spec.pattern.match(str(value)):
        return f"must be {spec.pattern_text}; got {value!r}"
    if spec.power_of_two and value & (value - 1):
        return f"must be a power of two; got {value!r}"
    return ""


def env_var(name: str) -> str:
    """The environment variable that sets the dotted setting ``name``."""
    return ENV_PREFIX + name.upper().replace(".", "_")


def add_flags(parser: argparse.ArgumentParser, command: str, skip: Sequence[str] = ()) -> None:
    """Add the flag of every setting ``command`` takes (absent flags leave lower layers)."""
    for item in settings().values():
        if item.spec.flag is None or command not in item.commands or item.name in skip:
            continue
        extra: dict[str, Any]
        if item.kind is bool:
            extra = {"action": argparse.BooleanOptionalAction}
        else:
            extra = {"type": item.kind, "metavar": item.key.upper()}
        if item.spec.choices:
            extra["metavar"] = "{" + ",".join(item.spec.choices) + "}"
        bounds = f"; {item.spec.bounds()}" if item.spec.bounds() else ""
        parser.add_argument(
            item.spec.flag,
            dest=item.name,
            default=argparse.SUPPRESS,
            help=f"{item.spec.help} (default: {item.default}{bounds}; env {item.env_var})",
            **extra,
        )


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, by dotted name."""
    known = settings()
    return {k: v for k, v in vars(args).items() if k in known}


def reference_markdown() -> str:
    """``docs/configuration.md``: every setting with its default, bounds, flag and variable."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings' declarations, each role's beside its code and composed in "
        "`shared/weightcast/runtime/config.py` (`python scripts/gen_config_docs.py`); a test "
        "fails when this page is stale.",
        "",
        "Settings come from, in rising precedence: defaults, a TOML file (`--config`), "
        "`WEIGHTCAST_*` environment variables, command-line flags. Every value is checked "
        "against its bounds before any work starts; a value out of bounds is one line naming "
        "the setting and where it came from, and exit status 2.",
    ]
    by_section: dict[str, list[Setting]] = {}
    for item in settings().values():
        by_section.setdefault(item.section, []).append(item)
    for section, items in by_section.items():
        table = "top level of the TOML file" if section == "common" else f"`[{section}]`"
        commands = ", ".join(f"`{c}`" for c in SECTION_COMMANDS[section])
        lines += ["", f"## {section} ({table}; commands {commands})", ""]
        lines += ["| setting | default | bounds | flag | meaning |", "|---|---|---|---|---|"]
        for item in items:
            flag = f"`{item.spec.flag}`" if item.spec.flag else ""
            if item.spec.commands:
                flag += f" ({', '.join(item.spec.commands)})"
            default = "" if item.default in ("", {}) else f"`{item.default}`"
            lines.append(
                f"| `{item.name}` | {default} | {item.spec.bounds()} | {flag} | {item.spec.help} |"
            )
    lines += [
        "",
        "Each setting's environment variable is its dotted name in capitals with `_` for "
        "`.`, after `WEIGHTCAST_`: `trainer.publish_every` is "
        "`WEIGHTCAST_TRAINER_PUBLISH_EVERY`. The trainer also takes torchtitan's job-config "
        "sections as `[trainer.<section>]` tables (`optimizer`, `lr_scheduler`, `training`, "
        "`parallelism`, `checkpoint`...); unknown names are refused.",
        "",
    ]
    return "\n".join(lines)


def _apply_toml(config: Config, table: Mapping[str, Any], source: str) -> None:
    known = settings()
    for key, value in table.items():
        if key in SECTIONS and isinstance(value, Mapping):
            for sub, sub_value in value.items():
                name = f"{key}.{sub}"
                if key == "trainer" and isinstance(sub_value, Mapping):
                    config.trainer.titan.setdefault(sub, {}).update(sub_value)
                elif name in known and known[name].kind is not dict:
                    where = f"{source}: {name}"
                    _set(config, known[name], _coerce(sub_value, known[name].kind, where), where)
                else:
                    raise ConfigError(f"{source}: unknown setting {name!r}")
        elif key in known:
            where = f"{source}: {key}"
            _set(config, known[key], _coerce(value, known[key].kind, where), where)
        else:
            top = sorted(k for k in known if "." not in k) + [f"[{s}]" for s in SECTIONS]
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {', '.join(top)}")


def _set(config: Config, item: Setting, value: Any, source: str) -> None:
    if item.name == "log_level" and isinstance(value, str):
        value = value.upper()
    setattr(getattr(config, item.section), item.key, value)
    config.sources[item.name] = source


def _coerce(value: Any, kind: type, source: str) -> Any:
    """Convert a TOML or environment value to the setting's type."""
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if kind is int and isinstance(value, float | bool):
            raise ValueError(f"not an integer: {value!r}")
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
