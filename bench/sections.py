"""The sections of docs/benchmarks.md that bench tools write, and the host line each starts with.

A tool's section lies between its two markers (``<!-- bench-NAME:begin -->`` and
``<!-- bench-NAME:end -->``, both inside the section the tool renders). ``replace_section`` puts a
newly rendered section where the markers stand and leaves the rest of the file as it is; where the
file lacks them, the section is appended. Text that must survive a regeneration belongs outside the
markers.

``machine()`` says where and when a figure was measured: the CPU model, its cores, the load average
at the start and the date (UTC).
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    date = time.strftime("%Y-%m-%d", time.gmtime())
    return f"{cpu}, {os.cpu_count()} cores, load average {load:.1f} at the start, {date}"


def replace_section(doc: Path, section: str, begin: str, end: str) -> None:
    """Put ``section`` (which carries the markers) where the ``begin``..``end`` markers stand in ``doc``, or
    at its end."""
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)


def opening(begin: str, title: str, command: str, started: str, setting: str, repeats: int,
            subject: str = "the engine's speed") -> list[str]:
    """A tool's section up to its description: the begin marker, the title, the line that says which
    command wrote it, where and when (``started``: ``machine()``) and under which ``setting``, and a
    warning when ``repeats`` (timed steps a row) is too few for the figures to mean ``subject``."""
    lines = [begin, "", f"### {title}", "",
             f"Written by `{command}` (not edited by hand). Machine: {started}; {setting}.", ""]
    if repeats < 5:
        lines += [f"**A smoke run (timed steps a row: {repeats}): the figures show the command works, not "
                  f"{subject}.**", ""]
    return lines


def publish(section: str, doc: Path, write: bool, begin: str, end: str) -> None:
    """Print ``section``; with ``write``, put it into ``doc`` in place of its markers' old one."""
    print("\n" + section)
    if write:
        replace_section(doc, section, begin, end)
        print(f"updated {doc}")
