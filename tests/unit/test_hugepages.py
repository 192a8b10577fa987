"""In-process engines of the CLI and the benches allocate like the serving workers: torch's transparent
huge pages on (``THP_MEM_ALLOC_ENABLE``), unless the caller set the switch itself.

torch ``madvise``s a CPU tensor of 2 MB or more with ``MADV_HUGEPAGE`` exactly when the switch was on at
its first allocation; the kernel then lists ``hg`` among the mapping's ``VmFlags``. A fresh interpreter
imports the entry module, then torch, and reports the flag of its tensor's mapping.
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
import torch
tensor = torch.empty(8 << 20, dtype=torch.uint8)  # kept: its mapping must exist below
address = tensor.data_ptr()
inside = False
for line in open("/proc/self/smaps"):
    first = line.split()[0]
    if "-" in first and not first.endswith(":"):
        low, high = (int(x, 16) for x in first.split("-"))
        inside = low <= address < high
    elif first == "VmFlags:" and inside:
        print("hg" in line.split()[1:])
"""


def huge_after_import(cases: list[tuple[str, str | None]]) -> list[bool]:
    """For each ``(module, THP_MEM_ALLOC_ENABLE or None)``, whether the tensor's mapping is huge (the
    interpreters run side by side)."""
    procs = []
    for module, thp in cases:
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if thp is not None:
            env["THP_MEM_ALLOC_ENABLE"] = thp
        procs.append(subprocess.Popen([sys.executable, "-c", PROBE, module], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        answers.append({"True": True, "False": False}[out.strip()])
    return answers


def test_entry_modules_turn_huge_pages_on_and_an_explicit_value_wins() -> None:
    cases: list[tuple[str, str | None]] = [("cli.main", None), ("bench", None), ("bench", "0"),
                                            ("json", None)]
    # on by default through either entry; off when the caller says 0; torch's own default is off
    assert huge_after_import(cases) == [True, True, False, False]
