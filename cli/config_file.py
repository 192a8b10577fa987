"""``--config path.yaml``: a YAML mapping whose keys are the command's flags.

Keys are flag names without the dashes (``num-decode`` or ``num_decode``);
values go through the same argparse conversion and checks as on the command
line, so a bad value names its key and flag. Flags given on the command line
override the file. (``cluster.config.describe`` renders the effective configuration for the start-up
log, keyed the same way, secrets masked.)
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_NOT_IN_FILE = frozenset({"config", "help", "command"})


class ConfigError(ValueError):
    """A bad configuration file; the message names the file, the key and the flag."""


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_IN_FILE}


def _flag(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _as_text(value: Any) -> str:
    if isinstance(value, dict):  # resource and label maps: {prefill_node: 1} -> "prefill_node=1"
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    flag = _flag(action)
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: key {key!r} ({flag}) must be true or false, got {value!r}")
        return value
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: key {key!r} ({flag}) takes one value, got a list")
    text = _as_text(value)
    try:
        converted = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{where}: key {key!r} ({flag}): {exc}") from None
    except (ValueError, TypeError):
        kind = getattr(action.type, "__name__", "")
        raise ConfigError(f"{where}: key {key!r} ({flag}): invalid {kind} value: {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: key {key!r} ({flag}): {value!r} is not one of {choices}")
    return converted


def load_config(path: str | Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Read ``path`` and convert every key with ``parser``'s own flag types; ``dest -> value``."""
    import yaml

    path = Path(path).expanduser()
    where = str(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {where}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config: {where} is not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {where} must hold a mapping of flag names to values")
    return convert_settings(raw, parser, where)


def key_dest(key: object) -> str:
    """The argparse ``dest`` a settings key names: ``num-decode``, ``--num-decode``, ``num_decode``."""
    return str(key).removeprefix("--").replace("-", "_")


def convert_settings(raw: Mapping[Any, Any], parser: argparse.ArgumentParser, where: str) -> dict[str, Any]:
    """Convert a mapping keyed by flag name with ``parser``'s own flag types; ``dest -> value``.

    The one validation path for settings that do not come from a command line (``--config`` files,
    the Ray Serve application's ``args``): a bad key or value raises ``ConfigError`` naming ``where``,
    the key and the flag."""
    actions = _actions(parser)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dest = key_dest(key)
        action = actions.get(dest)
        if action is None:
            raise ConfigError(f"{where}: unknown key {key!r} (no flag --{dest.replace('_', '-')})")
        out[dest] = _convert(action, str(key), value, where)
    return out


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; when it names ``--config FILE``, the file supplies defaults the flags override."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    sub = subparser(parser, args.command)
    sub.set_defaults(**load_config(path, sub))
    return parser.parse_args(argv)


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``parser`` itself when it has no subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser
