"""Request streams for the simulator, as token counts: ``pdserve bench``'s workloads, a trace file, or
the load the live planner measures.

Bench workloads are read with their own parameters and defaults (``planner/workload_params.py``, shared
with ``bench/workloads.py``) and drawn with the same distributions, by length only: the text never exists
here.
Prompt lengths add what the model's chat template adds (``ModelInfo.chat_user_tokens`` /
``chat_system_tokens``, measured by ``pdserve profile``). Prefix ids: 0 is the template's default
system prompt (``chat_shared_tokens``, every chat request without a system message), 1 ``mixed``'s RAG
instructions, ``2 + s`` ``shared-prefix``'s system prompt ``s``. ``multi-turn`` (turns wait for the
previous answer) and ``copy-heavy`` (lengths come from tokenizing its text) are not modelled.

A trace is a CSV file with the header ``arrival_s,input_tokens,output_tokens,prefix_id`` and optionally
``prefix_tokens`` (the shared length; without it, the shortest prompt with that prefix id minus one
token); ``prefix_id`` -1 or empty is no shared prefix.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from pathlib import Path

from planner.arrivals import poisson_arrivals
from planner.profile import ModelInfo
from planner.simulator import RequestSpec
from planner.workload_params import workload_params

DEFAULT_SYSTEM, RAG_SYSTEM, SHARED_PREFIX_BASE = 0, 1, 2
MODELLED = ("random", "shared-prefix", "long-context", "mixed")


def _lengths(name: str, p: dict[str, float], model: ModelInfo,
             rng: random.Random) -> Iterator[tuple[int, int, int, int]]:
    """(input tokens, output tokens, prefix id, prefix tokens) per request, forever."""
    chat_user = (model.chat_user_tokens, DEFAULT_SYSTEM if model.chat_shared_tokens else -1,
                 model.chat_shared_tokens)
    if name == "random":
        while True:
            yield int(p["input_len"]), int(p["output_len"]), -1, 0
    if name == "long-context":
        doc = int(p["context_len"]) - int(p["output_len"]) - int(p["margin"])
        if doc < 16:
            raise ValueError(f"long-context: context_len leaves {doc} document tokens; raise context_len")
        while True:
            yield doc, int(p["output_len"]), -1, 0
    if name == "shared-prefix":
        n_sys, n_q = int(p["num_prefixes"]), int(p["questions_per_prefix"])
        plen, qlen, out = int(p["prefix_len"]), int(p["question_len"]), int(p["output_len"])
        n_in = model.chat_system_tokens + plen + qlen
        while True:
            order = [s for s in range(n_sys) for _ in range(n_q)]
            rng.shuffle(order)
            for s in order:
                shared = rng.random() < float(p["share"])
                yield n_in, out, (SHARED_PREFIX_BASE + s if shared else -1), (plen if shared else 0)
    if name == "mixed":
        while True:
            n_out = rng.randint(int(p["output_min"]), int(p["output_max"]))
            if rng.random() < float(p["rag_share"]):
                ctx = rng.randint(int(p["rag_min"]), int(p["rag_max"]))
                q = rng.randint(int(p["short_min"]), int(p["short_max"]))
                sys_len = int(p["rag_system_len"])
                yield model.chat_system_tokens + sys_len + ctx + q + 1, n_out, RAG_SYSTEM, sys_len
            else:
                n = rng.randint(int(p["short_min"]), int(p["short_max"]))
                yield chat_user[0] + n, n_out, chat_user[1], chat_user[2]
    raise ValueError(f"--workload: {name!r} is not modelled by the simulator; use one of "
                     f"{', '.join(MODELLED)} or a --trace")


def bench_requests(name: str, params: dict[str, float], model: ModelInfo, *, seed: int = 0,
                   rate: float | None = None, num_requests: int | None = None) -> Iterator[RequestSpec]:
    """``pdserve bench``'s workload ``name`` as request specs: Poisson arrivals at ``rate`` (seeded) for
    ``num_requests`` requests, or (``rate`` None) an endless stream for a closed loop. ValueError (at
    once, not when iterated) for an unknown or unmodelled workload or a bad parameter."""
    merged = workload_params(name, params)  # validates the names and fills the defaults
    if name not in MODELLED:
        raise ValueError(f"--workload: {name!r} is not modelled by the simulator; use one of "
                         f"{', '.join(MODELLED)} or a --trace")
    lengths = _lengths(name, merged, model, random.Random(seed))
    if rate is None:
        return (RequestSpec(n_in, n_out, 0.0, pid, ptok) for n_in, n_out, pid, ptok in lengths)
    if num_requests is None:
        raise ValueError("an open-loop workload needs a request count")
    arrivals = poisson_arrivals(rate, num_requests, seed)
    return (RequestSpec(n_in, n_out, float(t), pid, ptok)
            for t, (n_in, n_out, pid, ptok) in zip(arrivals, lengths, strict=False))


def read_trace(path: str | Path) -> list[RequestSpec]:
    """The requests of a trace CSV (module docstring), sorted by arrival; ValueError names the line."""
    path = Path(path)
    rows: list[tuple[float, int, int, int, int | None]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"arrival_s", "input_tokens", "output_tokens", "prefix_id"}
        missing = need - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"--trace {path}: missing column(s) {', '.join(sorted(missing))}; the header "
                             "is arrival_s,input_tokens,output_tokens,prefix_id[,prefix_tokens]")
        for line, row in enumerate(reader, start=2):
            try:
                pid = int(row["prefix_id"]) if (row["prefix_id"] or "").strip() else -1
                ptok = row.get("prefix_tokens")
                item = (float(row["arrival_s"]), int(row["input_tokens"]), int(row["output_tokens"]), pid,
                        int(ptok) if ptok not in (None, "") else None)
            except (TypeError, ValueError):
                raise ValueError(f"--trace {path}:{line}: expected numbers, got {row}") from None
            if item[0] < 0 or item[1] < 1 or item[2] < 1:
                raise ValueError(f"--trace {path}:{line}: arrival_s must be >= 0 and token counts >= 1")
            rows.append(item)
    if not rows:
        raise ValueError(f"--trace {path}: no requests")
    shortest: dict[int, int] = {}
    for _, n_in, _, pid, _ in rows:
        shortest[pid] = min(shortest.get(pid, n_in), n_in)
    rows.sort(key=lambda r: r[0])
    return [RequestSpec(n_in, n_out, t, pid, (ptok if ptok is not None else shortest[pid] - 1) if pid >= 0
                        else 0) for t, n_in, n_out, pid, ptok in rows]
