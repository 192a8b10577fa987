"""One engine step, split by phase and by op class, beside the floors measured in the same run.

For each scenario (decode at ``--batches`` rows with ``--context`` tokens of
context each, and one ``--prefill``-token prompt chunk) and each configuration
(``--configs``: ``plain`` is torch's default ``F.linear``; ``prepacked`` is
``kernels.linear.PreparedLinear`` with MKL's packed product at one row; both run
the decoder's small ops as torch ops; ``fused`` is ``prepacked`` with the native
fused small ops (``kernels/native_ops.py``); ``layered`` is ``fused`` with the
packed native product (linear kernel ``native``), a few native calls per layer; ``native`` (the
engine's default) runs every layer of a step in one native call (``kernels/native_decoder.py``);
``compiled`` adds the
torch.compile'd decoder layers), the configurations run interleaved on one engine (the
weights are re-prepared between them), and each phase keeps its best time of
``--repeats`` steps. ``--gguf-activations float32,int8`` runs each configuration once per mode of the
products over GGUF blocks (``native/int8``, ...; the mode switches without packing again), on the blocks
``--dtype auto`` keeps:

- ``schedule``: ``Scheduler.schedule``;
- ``metadata``: ``ModelRunner.prepare`` (flat inputs, attention metadata);
- ``forward``: ``ModelRunner.run`` (the decoder), split once more under
  torch.profiler into GEMM, attention, norm/rope/activation and other (per-op
  self times, scaled to the unprofiled forward time);
- ``sampling``: ``LLMEngine.sample``, the LM head included (the greedy head where it applies:
  ``kernels/greedy_head.py``); ``output``: ``LLMEngine.process``.

Floors, measured in the same run: ``bw_floor`` = (weight bytes a decode step
reads + KV bytes read) / read bandwidth (a torch ``sum`` over ``--bw-bytes`` bytes,
best of 5), the weight bytes as the model holds them for its products
(``step_weight_bytes``: packed float32 panels, or GGUF blocks under ``--dtype
auto``, and the LM head as the step reads it);
``gemm_floor`` = the step's GEMMs at the best time any candidate kernel
(``bench.lab.linear_kernels``) reaches at that shape and row count.

    python -m bench.lab.step_profile [--configs plain,prepacked] [--batches 1,16,64]
        [--prefill 2048] [--repeats 10] [--threads N] [--dtype auto|float32]
        [--gguf-activations float32[,int8]] [--kv-cache-dtype auto|int8|fp8|int4]
        [--attention-backend auto|torch]
        [--json out.json] [--md out.md]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.lab.linear_kernels import sweep_shape
from bench.lab.step_ops import OP_CLASSES, op_class_split
from engine.config import GGUF_ACTIVATIONS, EngineConfig
from engine.engine import LLMEngine
from engine.kv_sizing import kv_block_bytes
from engine.sampling import SamplingParams
from kernels.linear import LinearKernel, PreparedLinear

PHASES = ("schedule", "metadata", "forward", "sampling", "output")


def read_bandwidth(nbytes: int) -> float:
    """Bytes/s of a torch ``sum`` over a float32 tensor of ``nbytes`` bytes, best of 5."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return nbytes / best


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every distinct weight parameter (tied embeddings counted once; a float model's)."""
    seen: set[int] = set()
    total = 0
    for p in engine.runner.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def step_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: each layer's products as they are held (the packed copy, GGUF
    blocks or the plain matrix) and its norms, the final norm, and the LM head as the step reads it (the
    greedy head's half-precision copy where it screens, else the head's product; its float32 rechecks of a
    few rows are left out). The embedding rows a step looks up are left out."""
    model = engine.runner.model
    total = _nbytes(model.norm)
    for layer in model.decoder_layers():
        for module in layer.modules():
            for value in vars(module).values():
                if isinstance(value, PreparedLinear):
                    total += _nbytes(value.packed if value.packed is not None else value.weight)
        total += sum(_nbytes(p) for name, p in layer.named_parameters() if "norm" in name)
    head = model.lm_head_linear
    if model.greedy_head is not None:
        return total + _nbytes(model.greedy_head.half)
    return total + _nbytes(head.packed if head.packed is not None else head.weight)


def gemm_floor(engine: LLMEngine, rows: int, head_rows: int, repeats: int) -> float:
    """Seconds of one step's GEMMs at the best candidate kernel per shape."""
    cfg = engine.model_config
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    total = 0.0
    for n, k in shapes:
        total += cfg.num_layers * min(sweep_shape(n, k, [rows], repeats)[rows].values())
    total += min(sweep_shape(cfg.vocab_size, h, [head_rows], repeats)[head_rows].values())
    return total


CONFIG_KERNELS: dict[str, LinearKernel] = {"plain": "plain", "prepacked": "prepacked", "fused": "prepacked",
                                           "layered": "native", "native": "native", "compiled": "prepacked"}


def set_config(engine: LLMEngine, label: str) -> None:
    """Prepare the engine for ``label``: a configuration, optionally ``/`` the GGUF blocks' activations."""
    config, _, mode = label.partition("/")
    if config not in CONFIG_KERNELS:
        raise SystemExit(f"--configs: unknown configuration {config!r}; "
                         f"choose from {', '.join(CONFIG_KERNELS)}")
    model = engine.runner.model
    if model.linear_kernel != CONFIG_KERNELS[config]:
        model.prepare_linears(CONFIG_KERNELS[config])
    if model.gguf_activations != (mode or "float32"):
        model.set_gguf_activations(mode or "float32")
    model.use_native_ops = config in ("fused", "layered", "native")
    model.use_native_decoder = config == "native"
    engine.runner.set_compiled(config == "compiled")


def start_scenario(engine: LLMEngine, batch: int, prompt_len: int) -> None:
    """Admit ``batch`` requests and run until every one is decoding (or, for a prefill, is queued)."""
    for rid in list(engine.requests):
        engine.abort_request(rid)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(7 + 31 * i + 13 * t) % vocab for t in range(prompt_len)]
        engine.add_request(prompt, params, request_id=f"s{batch}-{prompt_len}-{i}")


def timed_step(engine: LLMEngine) -> dict[str, float]:
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    out = engine.scheduler.schedule()
    t1 = time.perf_counter()
    inputs = engine.runner.prepare(out, engine.kv)
    t2 = time.perf_counter()
    rows = engine.runner.run(inputs)
    t3 = time.perf_counter()
    sampled = engine.sample(out, rows)
    t4 = time.perf_counter()
    engine.process(out, sampled)
    t5 = time.perf_counter()
    times.update(schedule=t1 - t0, metadata=t2 - t1, forward=t3 - t2, sampling=t4 - t3, output=t5 - t4)
    return times


def profile_scenario(engine: LLMEngine, configs: list[str], batch: int, prompt_len: int, prefill: bool,
                     repeats: int) -> dict[str, dict[str, float]]:
    """Best time per phase per config; prefill restarts the prompt before every measured step."""
    best = {c: dict.fromkeys(PHASES, float("inf")) for c in configs}
    if not prefill:
        start_scenario(engine, batch, prompt_len)
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
            engine.step()
    for rep in range(repeats + 1):  # the first round warms every config up
        for config in configs:
            set_config(engine, config)
            if prefill:
                start_scenario(engine, 1, prompt_len)
            times = timed_step(engine)
            if rep:
                for phase, t in times.items():
                    best[config][phase] = min(best[config][phase], t)
    for config in configs:
        set_config(engine, config)
        if prefill:
            start_scenario(engine, 1, prompt_len)
        out = engine.scheduler.schedule()
        inputs = engine.runner.prepare(out, engine.kv)
        backend = None if config.startswith("compiled") else engine.runner.backend
        split = op_class_split(lambda: engine.runner.run(inputs), backend)  # noqa: B023
        engine.process(out, None if prefill else engine.sample(out, engine.runner.run(inputs)))
        scale = best[config]["forward"] / max(sum(split.values()), 1e-12)
        best[config].update({f"fwd_{k}": v * scale for k, v in split.items()})
    return best


def markdown(rows: list[dict[str, object]], configs: list[str]) -> str:
    head = ["scenario", "config", "step ms", *PHASES, *(f"fwd {c}" for c in OP_CLASSES),
            "bw floor ms", "gemm floor ms", "step / bw floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        bw, gemm = row["bw_floor_s"], row["gemm_floor_s"]
        assert isinstance(bw, float) and isinstance(gemm, float)
        for config in configs:
            t = row[config]
            assert isinstance(t, dict)
            cells = [str(row["scenario"]), config, f"{t['step'] * 1e3:.1f}",
                     *(f"{t[p] * 1e3:.2f}" for p in PHASES),
                     *(f"{t['fwd_' + c] * 1e3:.1f}" for c in OP_CLASSES),
                     f"{bw * 1e3:.1f}", f"{gemm * 1e3:.1f}", f"{t['step'] / bw:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--configs", default="plain,prepacked")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    parser.add_argument("--prefill", type=int, default=2048, help="prompt chunk tokens; 0 skips it")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bw-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="auto",
                        help="the engine's --dtype (auto: a GGUF's block matrices as held)")
    parser.add_argument("--gguf-activations", default="float32",
                        help="the products over GGUF blocks: float32, int8, or both (float32,int8: each "
                             "configuration runs in each mode, labelled native/int8 ...)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's --kv-cache-dtype (a quantized cache's KV bytes count its scales)")
    parser.add_argument("--attention-backend", default="auto", help="the engine's --attention-backend")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIG_KERNELS:
            parser.error(f"--configs: unknown configuration {config!r}; "
                         f"choose from {', '.join(CONFIG_KERNELS)}")
    modes = args.gguf_activations.split(",")
    if any(mode not in GGUF_ACTIVATIONS for mode in modes):
        parser.error(f"--gguf-activations: choose from {', '.join(GGUF_ACTIVATIONS)}")
    compiled = "compiled" in configs
    if modes != ["float32"]:
        configs = [f"{config}/{mode}" for config in configs for mode in modes]
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(args.model, EngineConfig(
        enable_prefix_caching=False, max_num_seqs=max(batches), kv_cache_memory=1024**3,
        # 2,048-token steps at least, so the batches' prompts are prefilled in a few steps, not hundreds
        max_num_batched_tokens=max(args.prefill, max(batches), 2048), compile_cpu=compiled,
        num_threads=args.threads, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        # int8 checked here (an explicit --dtype, a CPU without VNNI); each label then sets its own mode
        gguf_activations="int8" if "int8" in modes else "float32"))
    bandwidth = read_bandwidth(args.bw_bytes)
    wbytes = step_weight_bytes(engine)
    bs = engine.config.block_size
    kv_token = kv_block_bytes(engine.model_config, bs, engine.config.kv_torch_dtype) / bs
    print(f"torch threads {torch.get_num_threads()}; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"weights {wbytes / 1e6:.0f} MB", flush=True)
    scenarios = [(f"decode x{b}", b, args.context, False) for b in batches]
    if args.prefill:
        scenarios.append((f"prefill {args.prefill}", 1, args.prefill, True))
    rows: list[dict[str, object]] = []
    for name, batch, prompt_len, prefill in scenarios:
        result = profile_scenario(engine, configs, batch, prompt_len, prefill, args.repeats)
        kv_read = kv_token * (prompt_len if prefill else batch * (prompt_len + args.repeats))
        rows_in = prompt_len if prefill else batch
        floor = gemm_floor(engine, rows_in, 1 if prefill else batch, max(3, args.repeats // 2))
        row: dict[str, object] = {"scenario": name, "bw_floor_s": (wbytes + kv_read) / bandwidth,
                                  "gemm_floor_s": floor}
        for config, t in result.items():
            t["step"] = sum(t[p] for p in PHASES)
            row[config] = t
        rows.append(row)
        print("\n".join(markdown([row], configs).splitlines()[2:]), flush=True)
    table = markdown(rows, configs)
    print("\n" + table)
    meta = {"torch_threads": torch.get_num_threads(), "dtype": args.dtype, "gguf_activations": modes,
            "kv_cache_dtype": args.kv_cache_dtype, "attention_backend": args.attention_backend,
            "read_bandwidth_gbs": bandwidth / 1e9, "weight_bytes": wbytes, "context": args.context,
            "repeats": args.repeats}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
