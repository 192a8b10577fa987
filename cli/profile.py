"""``pdserve profile``: measure one worker's prefill, decode and KV transfer costs on this machine.

    pdserve profile [--quick] [--torch-threads N] [--output profile.json] [engine flags]
    pdserve profile --calibrate URL --output profile.json

Builds the engine a worker would (the same engine flags as ``pdserve serve``, ``--torch-threads`` torch
threads) in this process, measures prefill steps against prompt and cached tokens, decode steps
against batch size and context, and NIXL reads against bytes (``planner/profiler.py``), fits the cost
models and writes the versioned profile JSON (``planner/profile.py``) that ``pdserve simulate`` and
``pdserve serve --planner`` read. ``--quick`` measures a small grid (under a minute for the default
model on two cores). ``--calibrate URL`` then measures, on a running server, the fixed costs of the
serving stack (one request at a time) and how much sharing the host's cores stretches the workers'
steps under a load of its own (``--calibrate-concurrency`` clients sending ``--calibrate-input-len``
random tokens for ``--calibrate-output-len`` tokens, for ``--calibrate-duration`` seconds): each
worker's step wall and CPU time and what its steps computed, read from ``/v1/workers`` before and
after, give the wait for a core (wall over CPU) and each role's contention (CPU over what the profile
prices those steps at, the profile being one worker alone), and the profile's ``host_cores``,
``decode_contention`` and ``prefill_contention`` are fitted so the simulator reproduces both on that
same load (``planner/calibrate.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cli.argtypes import RawDescriptionDefaultsHelpFormatter, number, positive
from cli.engine_args import add_engine_args, engine_config_from_args


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile", help="measure a worker's prefill, decode and KV transfer times; write a profile file",
        description=__doc__.split("\n\n", 2)[2].replace("``", "`") if __doc__ else None,
        formatter_class=RawDescriptionDefaultsHelpFormatter)
    p.add_argument("--output", type=Path, default=Path("profile.json"), metavar="FILE",
                   help="where to write the profile JSON")
    p.add_argument("--quick", action="store_true",
                   help="a small grid of points (under a minute for the default model on two cores)")
    p.add_argument("--torch-threads", type=positive(int), default=1, metavar="N",
                   help="torch threads, as each worker gets with `pdserve serve --torch-threads`")
    p.add_argument("--request-overhead", type=number(float, lambda v: v >= 0, ">= 0"), default=None,
                   metavar="SECONDS",
                   help="fixed latency outside the engines added to every simulated TTFT (HTTP, router, "
                        "Ray calls) (default: 0.02)")
    p.add_argument("--calibrate", default=None, metavar="URL",
                   help="instead of measuring an engine: read the profile --output names, measure the "
                        "serving stack's fixed costs (request overhead, per decode step; one request at a "
                        "time) and the host's stretch of the workers' steps under the --calibrate-* load "
                        "(its host_cores and contentions) on the server at URL, and write the "
                        "profile back")
    p.add_argument("--calibrate-concurrency", type=positive(int), default=4, metavar="N",
                   help="--calibrate's host load: clients, each sending its next request when the last "
                        "ends")
    p.add_argument("--calibrate-input-len", type=positive(int), default=256, metavar="TOKENS",
                   help="--calibrate's host load: prompt tokens a request")
    p.add_argument("--calibrate-output-len", type=positive(int), default=32, metavar="TOKENS",
                   help="--calibrate's host load: output tokens a request")
    p.add_argument("--calibrate-duration", type=positive(float), default=20.0, metavar="SECONDS",
                   help="--calibrate's host load: how long clients send")
    p.add_argument("--api-key", default=None, help="API key for --calibrate's server")
    add_engine_args(p)
    p.set_defaults(handler=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    from planner.profile import load_profile, save_profile

    if args.calibrate is not None:
        from planner.calibrate import HostLoad, calibrate

        load = HostLoad(concurrency=args.calibrate_concurrency, input_len=args.calibrate_input_len,
                        output_len=args.calibrate_output_len, duration_s=args.calibrate_duration)
        calibrated = calibrate(load_profile(args.output), args.calibrate, load=load, api_key=args.api_key,
                               progress=lambda m: print(m, file=sys.stderr))
        save_profile(calibrated, args.output)
        cores = "none" if calibrated.host_cores is None else f"{calibrated.host_cores:.2f}"
        cores += (f", contention decode {calibrated.decode_contention:.2f}, prefill "
                  f"{calibrated.prefill_contention:.2f}")
        print(f"request overhead {calibrated.request_overhead_s * 1000:.1f} ms, decode step base "
              f"{calibrated.decode.base_s * 1000:.2f} ms, host_cores {cores}; "
              f"profile written to {args.output}")
        return 0
    from planner.profiler import DEFAULT_REQUEST_OVERHEAD_S, run_profile

    config = engine_config_from_args(args)
    overhead = DEFAULT_REQUEST_OVERHEAD_S if args.request_overhead is None else args.request_overhead
    profile = run_profile(args.model, config, quick=args.quick, torch_threads=args.torch_threads,
                          request_overhead_s=overhead, progress=lambda m: print(m, file=sys.stderr))
    save_profile(profile, args.output)
    pf, dc, tr = profile.prefill, profile.decode, profile.transfer
    print(f"prefill step: {pf.base_s * 1000:.2f} ms + {pf.per_token_s * 1e6:.1f} us/token "
          f"+ {pf.per_attended_s * 1e9:.2f} ns/attended pair")
    print(f"decode step: {dc.base_s * 1000:.2f} ms + {dc.per_seq_s * 1000:.3f} ms/request "
          f"+ {dc.per_context_s * 1e6:.3f} us/context token")
    if dc.by_batch:
        table = ", ".join(f"{b}: {t * 1000:.1f}" for b, t in dc.by_batch)
        print(f"decode step by batch size, without context (ms): {table}")
    print(f"KV transfer: {tr.base_s * 1000:.2f} ms + bytes at {tr.bytes_per_s / 1e9:.2f} GB/s")
    print(f"profile written to {args.output}")
    return 0
