"""argparse value types shared by the ``pdserve`` subcommands (a bad value names the rule it broke), and
the help formatter that shows each flag's default from the parser itself."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from typing import Any


def number(kind: type[int] | type[float], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """Parse ``kind``; values for which ``ok`` is false fail with "... must be <rule>"."""
    def convert(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    return convert


class Converted:
    """A type calling ``parse(text)``; its ValueError becomes argparse's error. ``render`` writes a value
    back as a user would type it (help shows the default that way)."""

    def __init__(self, parse: Callable[[str], Any], render: Callable[[Any], str] | None = None) -> None:
        self.parse = parse
        self.render = render

    def __call__(self, text: str) -> Any:
        try:
            return self.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


def converted(parse: Callable[[str], Any], render: Callable[[Any], str] | None = None) -> Converted:
    return Converted(parse, render)


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    return number(kind, lambda v: v > 0, "> 0")


def parsed_by(parse: Callable[[str, str], Any], flag: str) -> Callable[[str], Any]:
    """A type calling ``parse(text, flag)``; its ValueError becomes argparse's error, flag prefix dropped."""
    def convert(text: str) -> Any:
        try:
            return parse(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    return convert


def shown_default(action: argparse.Action) -> str | None:
    """What ``--help`` shows as ``action``'s default (``%(default)s``, or the value rendered as a user
    types it: a size as ``512M``, an on/off flag as on or off, an empty list or mapping as none), or None
    where it shows none: no default (the help says in words what happens then), a plain switch, a
    positional argument, a non-empty collection."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or not action.option_strings:
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if default else "off"
    if action.nargs == 0:
        return None
    if isinstance(action.type, Converted) and action.type.render is not None:
        text = action.type.render(default)
    elif isinstance(default, enum.Enum):
        text = str(default.value)
    elif isinstance(default, float):
        text = f"{default:g}"
    elif isinstance(default, (dict, list, tuple, set)):
        return None if default else "none"
    else:
        return "%(default)s"
    return text.replace("%", "%%")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help, each option ending with ``(default: X)`` read from the parser (``shown_default``),
    so no help types a default by hand. A help that says ``when not given`` describes its default itself
    (one that is no value the flag accepts) and gets none appended."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "%(default)" in text or "when not given" in text:
            return text
        return f"{text} (default: {shown})"


class RawDescriptionDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """``DefaultsHelpFormatter`` keeping the description's own line breaks."""
