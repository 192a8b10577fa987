"""Defaults live in the config dataclasses only: every flag of ``pdserve serve`` and ``pdserve generate``
that lands in one has that dataclass's default, the empty command line builds the all-defaults
``ServeConfig``, and each "(default: X)" a flag's help shows is its real default, read from the parser."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any

import pytest

from cli.argtypes import shown_default
from cli.config_file import subparser
from cli.engine_args import engine_config_from_args
from cli.main import build_parser, main
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


@pytest.mark.parametrize("command", ["serve", "generate", "plan", "bench", "profile", "simulate"])
def test_help_shows_each_default_from_the_parser(command: str) -> None:
    """No help types a default by hand where the parser holds one: each "(default: X)" is appended by the
    formatter from the flag's own default, written so that the flag reads X back as that default."""
    parser = subparser(build_parser(), command)
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if shown_default(action) is None or "when not given" in (action.help or ""):
            continue
        assert "default:" not in (action.help or ""), f"{command} {action.dest}: a default typed by hand"
        found = re.search(r"\(default: ([^()]*)\)$", formatter._expand_help(action))
        assert found is not None, (command, action.dest)
        shown, default = found.group(1), action.default
        if isinstance(action, argparse.BooleanOptionalAction):
            assert shown == ("on" if default else "off"), action.dest
        elif isinstance(default, dict | list):
            assert shown == "none" and not default, action.dest
        elif callable(action.type):
            assert action.type(shown) == default, (action.dest, shown, default)
        else:
            assert shown == str(default), (action.dest, shown, default)
        checked += 1
    assert checked >= 5


def test_serve_help_shows_sizes_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "bytes for the paged KV cache" in text and "(default: 512M)" in text
    assert "(default: 1M)" in text and "(default: on)" in text  # --max-request-bytes, --share-cores
