"""GPU first light: every check of the CUDA path in one device call, each step timed, each result kept.

    python -m bench.lab.first_light [--out DIR] [--budget-s 480] [--dry-run]
    bash scripts/gpu_first_light.sh     # on the device machine: installs the carried wheels, then this

Steps, in order of value, each a child process given its share of ``--budget-s`` (what a step leaves
unused passes to the next), killed when it overruns; whatever it wrote stays:

1. ``env``: GPU, driver, Python, torch, Triton, transformers and the carried packages' versions.
2. ``tests``: ``tests/gpu`` (the Triton attention and MoE kernels against the torch reference, CUDA
   graphs on and off, the engine on CUDA against CPU, bfloat16 greedy against float32); flashinfer's
   and NIXL's tests skip themselves when their wheels are absent. JUnit XML beside the summary.
3. ``decode``: a Llama-3-8B-shaped model with random bfloat16 weights (``bench.lab.gpu``), decode at
   batch 1, 16 and 64 with 1,024 tokens of context, eager and replayed from the engine's CUDA graphs,
   each against the HBM roofline (weights + KV read / bandwidth).
4. ``prefill``: one 8,192-token prompt, tokens/s and MFU.
5. ``transformers``: transformers' static-cache ``generate`` at batch 1 on the same shapes.
6. ``transfer``: when ``nixl`` imports, NIXL READ between two processes' CUDA caches against the device's
   own copy (``bench.lab.transfer --device cuda``).

Everything lands in ``--out`` (default ``$OUT``, the device tool's folder): ``summary.json`` (each
step's status, seconds and results) and one ``<step>.json`` per step, rewritten after every figure.

``--dry-run`` runs every step on CPU with tiny shapes (``tests/gpu``'s bfloat16 test included, through
``PDSERVE_FIRST_LIGHT_DRY=1``; the transfer step only parses its command), so that a step that would
fail on the device for a Python reason fails here first (``tests/unit/test_first_light.py``). The
modules it imports need none of Ray, FastAPI, msgspec or llguidance, which the device image lacks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("env", "tests", "decode", "prefill", "transformers", "transfer")
SHARES = {"env": 0.04, "tests": 0.34, "decode": 0.22, "prefill": 0.08, "transformers": 0.12, "transfer": 0.20}
BATCHES = (1, 16, 64)


class Results:
    """One step's ``<step>.json``, rewritten whenever a figure is added (a killed step keeps its figures)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def add(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def step_env(out: Results, dry: bool) -> None:
    from bench.lab.gpu import versions

    for key, value in versions().items():
        out.add(key, value)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.add("gpu_memory_gib", round(props.total_memory / 2**30, 1))
        out.add("multiprocessors", props.multi_processor_count)


def step_tests(out: Results, dry: bool, budget_s: float, out_dir: Path) -> None:
    xml = out_dir / "gpu_tests.xml"
    env = {**os.environ, "PDSERVE_FIRST_LIGHT_DRY": "1" if dry else "0", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/gpu",
           f"--junitxml={xml}", "-o", "addopts=", "-o", "junit_family=xunit1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget_s)
    (out_dir / "gpu_tests.log").write_text(done.stdout + done.stderr)
    out.add("exit_code", done.returncode)
    if xml.is_file():
        root = ET.parse(xml).getroot()
        suite = root.find("testsuite") if root.tag == "testsuites" else root
        assert suite is not None
        for key in ("tests", "failures", "errors", "skipped", "time"):
            out.add(key, suite.get(key))
        out.add("failed", [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                           if case.find("failure") is not None or case.find("error") is not None])
        out.add("properties", {p.get("name"): p.get("value") for p in suite.iter("property")})
    out.add("tail", (done.stdout + done.stderr)[-3000:])


def _shape(dry: bool) -> tuple[Any, int, int]:
    """The model config, context and prefill length: Llama-3-8B's on a GPU, a tiny one in a dry run."""
    from bench.lab.gpu import LLAMA3_8B

    if not dry:
        return LLAMA3_8B, 1024, 8192
    from dataclasses import replace

    tiny = replace(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, name="tiny-llama-shaped")
    return tiny, 32, 64


def step_decode(out: Results, dry: bool, hbm_gbs: float) -> None:
    from bench.lab.gpu import BLOCK_SIZE, cuda_time, decode_step, graphed_decode_step, random_model
    from engine.kv_tensors import allocate_kv_cache

    config, ctx, _ = _shape(dry)
    device = _device(dry)
    model = random_model(config, device)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2
    per_seq = -(-(ctx + 1) // BLOCK_SIZE)
    kv = allocate_kv_cache(config, max(BATCHES) * per_seq + 1, BLOCK_SIZE, torch.bfloat16, device)
    out.add("model", config.name)
    out.add("hbm_gbs", hbm_gbs)
    for batch in BATCHES:
        floor = (weight_bytes + batch * (ctx + 1) * config.kv_bytes_per_token(2)) / (hbm_gbs * 1e9)
        for how, make in (("eager", decode_step), ("graphs", graphed_decode_step)):
            step = make(model, kv, "auto", batch, ctx, device)
            if step is None:
                out.add(f"batch{batch}_{how}", "no CUDA graphs for this backend")
                continue
            seconds = cuda_time(step, repeats=2 if dry else 20)
            out.add(f"batch{batch}_{how}", {
                "step_ms": round(seconds * 1e3, 3), "tok_s": round(batch / seconds, 1),
                "roofline_ms": round(floor * 1e3, 3), "roofline_fraction": round(floor / seconds, 3)})


def step_prefill(out: Results, dry: bool, peak_tflops: float) -> None:
    from bench.lab.gpu import BLOCK_SIZE, prefill_seconds, random_model
    from engine.kv_tensors import allocate_kv_cache

    config, _, n = _shape(dry)
    device = _device(dry)
    model = random_model(config, device)
    params = sum(p.numel() for p in model.parameters())
    kv = allocate_kv_cache(config, -(-n // BLOCK_SIZE) + 1, BLOCK_SIZE, torch.bfloat16, device)
    seconds = prefill_seconds(model, kv, "auto", n, device)
    out.add("tokens", n)
    out.add("ms", round(seconds * 1e3, 2))
    out.add("tok_s", round(n / seconds, 1))
    out.add("mfu", round(2 * params * n / seconds / (peak_tflops * 1e12), 3))


def step_transformers(out: Results, dry: bool) -> None:
    from bench.lab.gpu import transformers_decode

    config, ctx, _ = _shape(dry)
    out.add("batch1_tok_s", round(transformers_decode(config, ctx, 4 if dry else 64, _device(dry)), 1))


def step_transfer(out: Results, dry: bool, budget_s: float, out_dir: Path) -> None:
    if importlib.util.find_spec("nixl") is None:
        out.add("skipped", "nixl is not installed (carry its wheels: docs/gpu.md)")
        return
    rows = out_dir / "transfer_rows.json"
    cmd = [sys.executable, "-m", "bench.lab.transfer", "--device", "cuda", "--repeats", "5",
           "--json", str(rows)]
    if dry:
        cmd = [sys.executable, "-m", "bench.lab.transfer", "--help"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    out.add("exit_code", done.returncode)
    out.add("stdout", done.stdout[-6000:])
    out.add("stderr", done.stderr[-3000:])
    if rows.is_file():
        out.add("rows", json.loads(rows.read_text()))


def run_step(name: str, args: argparse.Namespace) -> None:
    out = Results(args.out / f"{name}.json")
    runners: dict[str, Callable[[], None]] = {
        "env": lambda: step_env(out, args.dry_run),
        "tests": lambda: step_tests(out, args.dry_run, args.step_budget_s, args.out),
        "decode": lambda: step_decode(out, args.dry_run, args.hbm_gbs),
        "prefill": lambda: step_prefill(out, args.dry_run, args.peak_tflops),
        "transformers": lambda: step_transformers(out, args.dry_run),
        "transfer": lambda: step_transfer(out, args.dry_run, args.step_budget_s, args.out),
    }
    runners[name]()


def run_all(args: argparse.Namespace, steps: list[str]) -> dict[str, Any]:
    """Each step in a child process within its share of the budget; the summary as it stands."""
    summary: dict[str, Any] = {"dry_run": args.dry_run, "budget_s": args.budget_s, "steps": {}}
    start = time.monotonic()
    spare = 0.0
    for name in steps:
        left = args.budget_s - (time.monotonic() - start)
        share = min(left, SHARES[name] * args.budget_s + spare)
        if share < 5:
            summary["steps"][name] = {"status": "not run: out of time"}
            continue
        cmd = [sys.executable, "-m", "bench.lab.first_light", "--step", name, "--out", str(args.out),
               "--step-budget-s", f"{share - 3:.0f}", "--hbm-gbs", str(args.hbm_gbs),
               "--peak-tflops", str(args.peak_tflops), *(["--dry-run"] if args.dry_run else [])]
        began = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=share,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
            log = done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            status = f"killed after {share:.0f} s"
            log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        seconds = time.monotonic() - began
        spare = max(0.0, share - seconds)
        path = args.out / f"{name}.json"
        results = json.loads(path.read_text()) if path.is_file() else {}
        summary["steps"][name] = {"status": status, "seconds": round(seconds, 1), "results": results,
                                  **({"log": log[-4000:]} if status != "ok" else {})}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"first light: {name}: {status} in {seconds:.1f} s", flush=True)
    return summary


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.first_light", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "first_light_out")),
                   help="where the results go (default: $OUT, else ./first_light_out)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for every step together (default: 480)")
    p.add_argument("--dry-run", action="store_true", help="every step on CPU with tiny shapes")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"which steps, in order (default: {','.join(STEPS)})")
    p.add_argument("--hbm-gbs", type=float, default=4800.0,
                   help="HBM GB/s for the roofline (default: 4800, an H200's)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 TFLOP/s for MFU (default: 989)")
    p.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # a child: run this step alone
    p.add_argument("--step-budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)}; known: {', '.join(STEPS)}")
    if args.budget_s < 30:
        p.error("--budget-s must be at least 30")
    if not args.dry_run and not args.step and not torch.cuda.is_available():
        p.error("no CUDA device here: pass --dry-run to run every step on CPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step:
        run_step(args.step, args)
        return 0
    summary = run_all(args, args.steps)
    return 0 if all(s["status"] == "ok" for s in summary["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
