"""The GPU first-light script (``bench/lab/first_light.py``) before any device sees it: its import set loads
without the packages the device image lacks, and its dry run runs every step on CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# not in the device image (docs/gpu.md); nixl and flashinfer only when their wheels are carried
ABSENT = ("ray", "fastapi", "msgspec", "llguidance", "nixl", "flashinfer", "uvicorn", "starlette")
IMPORT_SET = ("bench.lab.first_light", "bench.lab.gpu", "engine", "engine.llm", "kernels.triton_backend",
              "kernels.triton_mla", "kernels.mla_backends", "tests.families",
              *(f"tests.gpu.{p.stem}" for p in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))))
PROBE = """
import sys
for name in {absent!r}:
    sys.modules[name] = None  # as if not installed: importing fails, importlib.util.find_spec gives None
import pytest
for module in {modules!r}:
    try:
        __import__(module)
    except pytest.skip.Exception:
        pass  # a GPU test module that skips itself without its package (NIXL's)
print("imported", len({modules!r}))
"""


def test_the_import_set_needs_none_of_the_absent_packages() -> None:
    """Every module the script and ``tests/gpu`` import, with Ray, FastAPI, msgspec, llguidance, NIXL and
    flashinfer absent."""
    code = PROBE.format(absent=ABSENT, modules=IMPORT_SET)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(IMPORT_SET)}" in done.stdout


def test_the_dry_run_runs_every_step(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.lab.first_light", "--dry-run", "--out", str(tmp_path),
                           "--budget-s", "400"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, json.dumps(summary, indent=1)[-4000:]
    steps = summary["steps"]
    assert list(steps) == ["env", "tests", "decode", "prefill", "transformers", "transfer"]
    assert all(s["status"] == "ok" for s in steps.values())
    assert steps["env"]["results"]["torch"]
    tests = steps["tests"]["results"]
    assert tests["exit_code"] == 0 and tests["failures"] == "0" and tests["errors"] == "0"
    assert float(tests["properties"]["bf16_equal_share"]) > 0.5  # the bfloat16 test ran, on CPU
    for batch in (1, 16, 64):
        assert steps["decode"]["results"][f"batch{batch}_eager"]["tok_s"] > 0
    assert steps["prefill"]["results"]["tok_s"] > 0 and steps["transformers"]["results"]["batch1_tok_s"] > 0
    assert steps["transfer"]["results"]["exit_code"] == 0  # --help: the transfer bench imports and parses


def _python312() -> str | None:
    found = shutil.which("python3.12")
    candidates = [found] if found else []
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for exe in candidates:
        done = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                              text=True, check=False)
        if done.returncode == 0 and done.stdout.strip() == "(3, 12)":
            return exe
    return None


@pytest.mark.skipif(_python312() is None, reason="no Python 3.12 interpreter on this machine")
def test_the_device_python_compiles_the_import_set() -> None:
    """The device image runs Python 3.12 (this suite, 3.11): every source the script can load compiles
    there (syntax only: 3.12 has none of the packages)."""
    code = ("import pathlib, sys\n"
            "paths = [p for d in sys.argv[1:] for p in ([pathlib.Path(d)] if d.endswith('.py')"
            " else pathlib.Path(d).rglob('*.py'))]\n"
            "for p in paths: compile(p.read_text(), str(p), 'exec')\n"
            "print('compiled', len(paths))\n")
    dirs = ["bench", "engine", "kernels", "transfer", "messages", "tests/gpu", "tests/families.py"]
    done = subprocess.run([str(_python312()), "-c", code, *dirs], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100
