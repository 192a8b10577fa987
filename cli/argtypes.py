"""argparse value types shared by the ``pdserve`` subcommands: a bad value names the rule it broke."""

from __future__ import annotations

import argparse
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


def converted(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A type calling ``parse(text)``; its ValueError becomes argparse's error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


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
