"""Defaults live in the config dataclasses only: every flag of ``pdserve serve`` and ``pdserve generate``
that lands in one has that dataclass's default, the empty command line builds the all-defaults
``ServeConfig``, and each "(default: X)" a flag's help shows is its real default."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any

import pytest

from cli.config_file import subparser
from cli.engine_args import engine_config_from_args, parse_size, size, size_or_zero
from cli.main import build_parser
from cli.serve_config import serve_config_from_args
from cluster.config import (
    ENGINE_WITHOUT_FLAG,
    SETTINGS,
    PlannerOptions,
    ServeConfig,
    TraceFlags,
    describe,
    setting_keys,
)
from cluster.placement import WorkerOptions
from engine.config import EngineConfig
from router.config import ClientConfig, RouterSettings

NOT_SETTINGS = {"help", "config", "prompts", "chat"}  # no config dataclass field behind them
LEAF_DEFAULTS: dict[str, Any] = {
    "engine": EngineConfig(), "router": RouterSettings(), "client": ClientConfig(),
    "prefill": WorkerOptions(), "decode": WorkerOptions(), "tracing": TraceFlags(),
    "planner": PlannerOptions(),
}
TOP_DEFAULTS = ServeConfig()


def flags(command: str) -> dict[str, argparse.Action]:
    parser = subparser(build_parser(), command)
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in NOT_SETTINGS}


def dataclass_default(path: str) -> Any:
    """The default of the field at ``path`` in ServeConfig, read off the dataclass that declares it."""
    head, _, leaf = path.partition(".")
    return getattr(LEAF_DEFAULTS[head], leaf) if leaf else getattr(TOP_DEFAULTS, head)


def test_every_serve_flag_lands_in_the_config() -> None:
    assert sorted(flags("serve")) == setting_keys()


def test_serve_flag_defaults_are_the_dataclass_defaults() -> None:
    for dest, action in flags("serve").items():
        for path in SETTINGS.get(dest, (f"engine.{dest}",)):
            assert action.default == dataclass_default(path), (dest, path, action.default)


def test_engine_flags_are_engine_config_fields_with_its_defaults() -> None:
    engine = {f.name for f in fields(EngineConfig)} - ENGINE_WITHOUT_FLAG
    for command in ("serve", "generate"):
        actions = flags(command)
        assert engine <= set(actions), f"{command}: no flag for {engine - set(actions)}"
        for name in engine:
            assert actions[name].default == getattr(EngineConfig(), name), (command, name)
    args = build_parser().parse_args(["generate", "hello"])
    assert engine_config_from_args(args) == EngineConfig()


def test_empty_command_line_is_the_default_config() -> None:
    config = serve_config_from_args(build_parser().parse_args(["serve"]))
    assert config == ServeConfig()
    assert (config.engine, config.router, config.client, config.tracing) == (
        EngineConfig(), RouterSettings(), ClientConfig(), TraceFlags())
    for role in ("prefill", "decode"):
        assert getattr(config, role) == WorkerOptions(resources_flag=f"--{role}-resources")
    assert describe(config) == describe(ServeConfig())


def _shown(action: argparse.Action) -> str | None:
    found = re.search(r"\(default: ([^,;)]+)", action.help or "")
    return found.group(1).strip() if found else None


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_shows_the_real_default(command: str) -> None:
    checked = 0
    for dest, action in flags(command).items():
        shown, default = _shown(action), action.default
        if shown is None or default is None or shown.startswith("$"):
            continue
        if isinstance(default, bool):
            assert shown == ("on" if default else "off"), dest
        elif isinstance(default, dict):
            assert shown == "none" and default == {}, dest
        elif action.type in (size, size_or_zero):
            assert parse_size(shown, allow_zero=True) == default, dest
        elif isinstance(default, (int, float)):
            assert float(shown) == default, (dest, shown, default)
        else:
            assert shown == default, (dest, shown, default)
        checked += 1
    assert checked >= 15
