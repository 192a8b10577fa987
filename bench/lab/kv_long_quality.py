"""What KV storage and KV eviction cost on long real text: perplexity and needle retrieval.

Each ``--runs`` entry is ``label=kv_cache_dtype[:budget[:policy]]``: the KV stored as
``kv_cache_dtype`` (``auto``: the model dtype) and, with a budget (a fraction of ``--window``), bounded
to that many tokens by ``policy``: ``window``, StreamingLLM's rule as the engine applies it
(``KV_SINKS`` tokens kept from the start, the rest a sliding window of whole blocks,
``engine/scheduler.py``), ``h2o`` or ``headwise`` (``--kv-eviction h2o|headwise`` with that
``--kv-budget`` and its default recent half, ``engine/kv_eviction.py``). A bounded entry's served runs (the
needles) take ``--chunk``
tokens a step too, so a prompt is cut as in the perplexity pass. For every entry:

* **perplexity** of ``--text`` (default ``/usr/share/common-licenses/GPL-3``) read in independent
  windows of ``--window`` tokens, each fed ``--chunk`` tokens per step through the paged cache
  (``bench.lab.kv_quant.perplexity``'s way), the budget applied between chunks exactly as the scheduler
  drops blocks (positions stay absolute);
* **needle retrieval**: a sentence ``The secret number is NNNN.`` planted at each of ``--depths`` of a
  ``--haystack``-token stretch of the same text, which then ends with ``The secret number is``; a trial
  passes when the greedy continuation (8 tokens, served by the engine with that KV configuration)
  starts with the number.
* **KV bytes per token**: ``kv_block_bytes / block_size`` (codes and scales) times the kept share.

``--int4-group`` sets the channels an int4 range covers, to compare groupings.

    python -m bench.lab.kv_long_quality --chunk 32 \
        --runs "float32=auto,int8=int8,int4=int4,window 50%=auto:0.5,h2o 50%=auto:0.5:h2o"
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.kv_sizing import kv_block_bytes, kv_dtype_name
from engine.outputs import RequestMetrics
from kernels import AttentionMetadata, kv_int4

NUMBERS = (7421, 3958, 6134, 8207)
KV_SINKS = 16


def parse_run(spec: str) -> tuple[str, str, float | None, str]:
    """``label=dtype[:fraction[:policy]]``: policy ``window`` (StreamingLLM, the default), ``h2o`` or
    ``headwise``."""
    label, rest = spec.split("=", 1)
    dtype, _, tail = rest.partition(":")
    budget, _, policy = tail.partition(":")
    return label, dtype, float(budget) if budget else None, policy or "window"


@dataclass
class _Sequence:
    """What ``KvEviction.fit`` reads of a request."""

    request_id: str
    num_computed_tokens: int = 0
    kv_dropped_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))

    @property
    def kv_tokens(self) -> int:
        return self.num_computed_tokens - self.kv_dropped_tokens


@torch.inference_mode()
def bounded_perplexity_nll(engine: LLMEngine, ids: list[int], chunk: int, budget: int | None) -> float:
    """Summed NLL of ``ids[1:]``, ``chunk`` tokens a step. With ``budget`` and ``--kv-eviction`` the
    engine's ``KvEviction.fit`` runs before each chunk, as the scheduler calls it; with ``budget`` alone
    the sequence keeps ``KV_SINKS`` tokens of blocks from its start and drops whole blocks the window of
    ``budget - KV_SINKS`` tokens has passed, between steps (``Scheduler._slide``'s rule)."""
    seq = _Sequence("ppl")
    bs = engine.config.block_size
    if not engine.kv.allocate(seq.request_id, len(ids)):
        raise RuntimeError("the KV cache is too small for one window")
    runner = engine.runner
    sink_blocks = -(-KV_SINKS // bs)
    nll = 0.0
    try:
        while seq.num_computed_tokens < len(ids):
            start = seq.num_computed_tokens
            n = min(chunk, len(ids) - start)
            if engine.eviction is not None:
                n = engine.eviction.fit(engine.kv, seq, n)  # type: ignore[arg-type]
            end = start + n
            table = engine.kv.blocks_of(seq.request_id)
            meta = AttentionMetadata.build(bs, [n], [end - seq.kv_dropped_tokens], [table])
            runner.backend.prepare(meta)
            hidden = runner.model(torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_cache,
                                  runner.backend, meta, runner.kv_scales)
            logp = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            targets = ids[start + 1 : end + 1]
            nll -= float(logp[: len(targets)].gather(1, torch.tensor(targets)[:, None]).sum())
            seq.num_computed_tokens = end
            while (budget is not None and engine.eviction is None
                   and end - (sink_blocks * bs + seq.kv_dropped_tokens + bs) >= budget - KV_SINKS):
                engine.kv.drop_block(seq.request_id, sink_blocks)
                seq.kv_dropped_tokens += bs
    finally:
        engine.kv.free(seq.request_id)
    return nll


def needle_prompts(llm: LLM, text: str, haystack: int, depths: list[float]) -> list[tuple[list[int], int]]:
    tok = llm.engine.tokenizer
    hay = tok.encode(text)[:haystack]
    question = tok.encode("\n\nThe secret number is")
    out = []
    for number in NUMBERS:
        needle = tok.encode(f" The secret number is {number}. ")
        for depth in depths:
            at = int(len(hay) * depth)
            out.append((hay[:at] + needle + hay[at:] + question, number))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True,
                        help="label=kv_cache_dtype[:budget fraction[:window|h2o|headwise]], comma-separated")
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--haystack", type=int, default=1800)
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--int4-group", type=int, default=None,
                        help="channels sharing one int4 range (kernels/kv_int4.py's GROUP) for this run")
    args = parser.parse_args(argv)
    if args.int4_group is not None:
        kv_int4.GROUP = args.int4_group
    text = Path(args.text).read_text()
    depths = [float(d) for d in args.depths.split(",")]
    rows = ["| KV | kept | KV bytes per token | perplexity | needle |", "|---|---:|---:|---:|---:|"]
    for spec in args.runs.split(","):
        label, dtype, fraction, policy = parse_run(spec)
        budget = None if fraction is None else int(args.window * fraction)
        bounded: dict[str, object] = {}
        if budget is not None and policy in ("h2o", "headwise"):
            bounded = {"kv_eviction": policy, "kv_budget": budget, "max_num_batched_tokens": args.chunk}
        elif budget is not None:
            bounded = {"kv_sinks": KV_SINKS, "kv_window": budget - KV_SINKS,
                       "max_num_batched_tokens": args.chunk}
        llm = LLM(args.model, kv_cache_dtype=dtype, num_threads=args.threads,
                  num_kv_blocks=args.window // 16 + 64, **bounded)  # type: ignore[arg-type]
        try:
            engine = llm.engine
            ids = engine.tokenizer.encode(text)
            nll, count = 0.0, 0
            for start in range(0, len(ids) - 1, args.window):
                part = ids[start : start + args.window]
                nll += bounded_perplexity_nll(engine, part, args.chunk, budget)
                count += len(part) - 1
            trials = needle_prompts(llm, text, args.haystack, depths)
            outs = llm.generate([p for p, _ in trials], SamplingParams(max_tokens=8, temperature=0.0))
            hits = sum(engine.tokenizer.decode(o.token_ids).strip().startswith(str(n))
                       for o, (_, n) in zip(outs, trials, strict=True))
            per_token = kv_block_bytes(engine.model_config, engine.config.block_size,
                                       engine.config.kv_torch_dtype) / engine.config.block_size
            kept = 1.0 if fraction is None else fraction
        finally:
            llm.close()
        name = kv_dtype_name(engine.config.kv_torch_dtype)
        ppl = math.exp(nll / count)
        rows.append(f"| {label} ({name}) | {kept:.0%} | {per_token * kept:,.0f} | {ppl:.3f} | "
                    f"{hits}/{len(trials)} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
