"""The ``pdserve`` command line.

``pdserve generate PROMPT...`` runs prompts through the in-process engine and
prints each completion with its token counts and timings. The engine flags are
defined once in :func:`add_engine_args` so every subcommand that builds an
engine accepts the same ones.

In-process engines (``generate``, ``profile``) read their weights through 2 MB pages, as the serving
workers do (``THP_MEM_ALLOC_ENABLE``, set at import here, before anything imports torch; an explicit
value wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from cli.argtypes import converted

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # see the module doc; torch is not imported yet

PROG = "pdserve"
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "int8")
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class UsageError(Exception):
    """A bad command line; its message names the flag."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``pdserve: error: ...``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_size(text: str, allow_zero: bool = False) -> int:
    """Parse a byte count: ``1048576``, ``512M``, ``2G``, ``1.5GiB`` (binary units: K = 1024).

    ``0`` is accepted only with ``allow_zero`` (sizes whose 0 means "off")."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"invalid size {text!r}; use bytes or a number with K, M, G or T (e.g. 512M, 2G)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if allow_zero and value == 0:
        return 0
    if value < 1:
        raise ValueError(f"invalid size {text!r}; must be at least 1 byte" + (" or 0" if allow_zero else ""))
    return int(value)


size = converted(parse_size)
size_or_zero = converted(functools.partial(parse_size, allow_zero=True))  # a size whose 0 means off


def _number(kind: type[int] | type[float], low: float | None = None, high: float | None = None,
            low_open: bool = False, what: str = "") -> Callable[[str], float]:
    """An argparse type that converts with ``kind`` and checks the bounds."""

    def convert(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; must be {what}")
        return value

    return convert


def _device(text: str) -> str:
    if not _DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}; use cpu, cuda or cuda:N")
    return text


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags that configure an engine (model, memory, scheduler limits). Each flag's dest is
    an ``EngineConfig`` field and its default is that field's default (``engine_config_from_args``)."""
    from engine.config import ATTENTION_BACKENDS, EngineConfig
    from engine.spec_config import parse_speculative_config
    from kernels.linear import LINEAR_KERNELS

    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a Hugging Face model folder (config.json, tokenizer, *.safetensors) or a .gguf "
                        "file; default: the built-in SmolLM2-135M-Instruct Q4_1 GGUF in "
                        "$PDSERVE_CACHE/models (fetched by scripts/fetch_model.py)")
    g.add_argument("--dtype", choices=("auto", *DTYPES), default=d.dtype,
                   help="dtype of weights, activations and KV cache; auto is bfloat16 on CUDA and float32 "
                        "on CPU (default: auto)")
    g.add_argument("--device", type=_device, default=d.device,
                   help="torch device: cpu, cuda or cuda:N (default: cpu)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache storage: auto (the --dtype), fp8 (e4m3), fp8_e5m2 or int8; quantized "
                        "blocks keep float32 per-block, per-head scales and hold 2x the tokens of "
                        "bf16 (4x of float32) per byte (default: auto)")
    g.add_argument("--preemption-mode", choices=("recompute", "swap"), default=d.preemption_mode,
                   help="when KV runs out, the least important running request (highest priority value) "
                        "is preempted: recompute its KV on resume, or swap its blocks to host memory and "
                        "back (default: recompute)")
    g.add_argument("--swap-space", type=size, default=d.swap_space, metavar="SIZE",
                   help="host memory for swapped-out KV with --preemption-mode swap; requests that do "
                        "not fit are recomputed (default: 1G)")
    g.add_argument("--kv-offload-bytes", type=size_or_zero, default=d.kv_offload_bytes, metavar="SIZE",
                   help="host memory for prefix-cache blocks evicted from the KV cache; a later prefix "
                        "hit copies them back instead of recomputing (default: 0, off)")
    g.add_argument("--kv-offload-dir", default=d.kv_offload_dir, metavar="DIR",
                   help="disk tier below the host tier: one file per block plus an index, kept across "
                        "restarts for the same model and KV layout (default: none)")
    g.add_argument("--kv-offload-disk-bytes", type=size, default=d.kv_offload_disk_bytes, metavar="SIZE",
                   help="most bytes the disk tier (--kv-offload-dir) holds; its least recently used "
                        "block file is deleted past that (default: 8G)")
    g.add_argument("--kv-window", type=int, default=d.kv_window, metavar="N",
                   help="bounded KV for endless sessions: keep only the last N tokens' K/V (whole "
                        "blocks) plus the --kv-sinks first tokens; generation is then not limited by "
                        "the pool (default: off; models with a native sliding_window use theirs)")
    g.add_argument("--kv-sinks", type=int, default=d.kv_sinks, metavar="K",
                   help="attention sinks kept with --kv-window: the first K tokens, rounded up to whole "
                        "blocks (default: 0)")
    g.add_argument("--block-size", type=int, default=d.block_size, metavar="N",
                   help="tokens per KV cache block, a power of two (default: 16)")
    g.add_argument("--kv-cache-memory", type=size, default=d.kv_cache_memory, metavar="SIZE",
                   help="bytes for the paged KV cache, with optional K/M/G/T suffix, 1024-based "
                        "(default: 512M); ignored when --num-kv-blocks is given")
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, metavar="N",
                   help="exact number of KV cache blocks (default: derived from --kv-cache-memory)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse KV blocks of identical prompt prefixes across requests (default: on)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, metavar="N",
                   help="most tokens (prompt chunks + decodes) run in one engine step (default: 2048)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help="most requests running at once (default: 128)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, metavar="N",
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--seed", type=int, default=d.seed, metavar="N",
                   help="seed of the engine's random sampling (default: 0)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                   help="attention kernels: auto (flashinfer on CUDA when installed and the KV cache is "
                        "not quantized, else Triton on CUDA; the CPU kernels on CPU), triton, flashinfer "
                        "or torch (default: auto)")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="run the model eagerly: no compiled forward (--compile-cpu), no CUDA graphs")
    g.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default=d.linear_kernel,
                   help="matrix products on CPU: native (one native product for every row count against "
                        "weights packed once at load, replacing the decoder's unpacked ones; prepacked where "
                        "the native kernels cannot be built), prepacked (MKL's product packed for one row, "
                        "oneDNN's to 64 rows, MKL's or oneDNN's SGEMM above; an extra copy of the weights) "
                        "or plain (torch's F.linear) (default: native)")
    g.add_argument("--compile-cpu", action=argparse.BooleanOptionalAction, default=d.compile_cpu,
                   help="compile the decoder layers with torch.compile (inductor) for decode batches padded "
                        "to buckets, cached on disk under $PDSERVE_CACHE/inductor; it did not pay on the "
                        "CPUs measured, see docs/benchmarks.md (default: off)")
    g.add_argument("--speculative-config", type=converted(parse_speculative_config),
                   default=d.speculative_config, metavar="JSON",
                   help="speculative decoding, vLLM's shape: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                        "proposes the tokens that followed the latest earlier match of the last tokens and "
                        "verifies them in one forward; '{\"method\": \"draft_model\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 4}' proposes with a smaller local model of the same "
                        "vocabulary on the decode worker; greedy output is unchanged, sampled output keeps "
                        "its distribution (default: None, off)")
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size, metavar="N",
                   help="devices one engine spans (tensor parallelism, vLLM's flag): N rank processes, each "
                        "holding 1/N of the heads, MLP and vocabulary; `pdserve generate` starts them itself "
                        "(gloo on CPU, NCCL on CUDA); under `pdserve serve` each worker does, for both "
                        "roles unless --prefill-tp / --decode-tp say otherwise (default: 1)")
    g.add_argument("--tp-timeout", dest="tp_timeout_s", type=float, default=d.tp_timeout_s, metavar="SECONDS",
                   help="with --tensor-parallel-size above 1, the longest any collective of the rank group "
                        "waits: a dead or hung rank is an error after it, never a hang (default: 120)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization, metavar="F",
                   help="with --device cuda, the fraction of the device's memory the engine may use "
                        "(weights plus KV cache), in (0, 1] (default: 0.9)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the flags added by :func:`add_engine_args` (each dest names its field;
    fields without a flag keep their defaults). Raises ValueError naming the flag on a bad value."""
    from engine.config import EngineConfig

    given = vars(args)
    return EngineConfig(**{f.name: given[f.name] for f in dataclasses.fields(EngineConfig)
                           if f.name in given})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``engine.SamplingParams``."""
    g = parser.add_argument_group("sampling")
    penalty = _number(float, -2.0, 2.0, what="in [-2, 2]")
    g.add_argument("--max-tokens", type=_number(int, 1, what=">= 1"), default=64, metavar="N",
                   help="most tokens to generate per prompt (default: 64)")
    g.add_argument("--temperature", type=_number(float, 0.0, what=">= 0"), default=0.0, metavar="T",
                   help="sampling temperature; 0 means greedy (default: 0)")
    g.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True, what="in (0, 1]"),
                   default=1.0, metavar="P",
                   help="keep the smallest set of tokens whose probability sums to P (default: 1, off)")
    g.add_argument("--top-k", type=_number(int, 0, what=">= 0"), default=0, metavar="K",
                   help="keep only the K most likely tokens; 0 means off (default: 0)")
    g.add_argument("--min-p", type=_number(float, 0.0, 1.0, what="in [0, 1]"), default=0.0, metavar="P",
                   help="drop tokens less likely than P x the top token's probability (default: 0, off)")
    g.add_argument("--presence-penalty", type=penalty, default=0.0, metavar="X",
                   help="subtract this from the logit of every token already generated (default: 0)")
    g.add_argument("--frequency-penalty", type=penalty, default=0.0, metavar="X",
                   help="subtract this x its count from the logit of each generated token (default: 0)")
    g.add_argument("--repetition-penalty", type=_number(float, 0.0, low_open=True, what="> 0"),
                   default=1.0, metavar="X",
                   help="divide positive (multiply negative) logits of tokens seen in the prompt or "
                        "output by this; 1 means off (default: 1)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token until --max-tokens")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    from engine import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="pdserve: disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    gen = sub.add_parser(
        "generate", help="generate completions for prompts with the in-process engine",
        description="Generate a completion for each PROMPT (batched together) and print it, followed "
                    "by its prompt tokens, output tokens, time to first token and output tokens/s.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; several are run as one batch")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each prompt as a user message in the model's chat template "
                          "(default: when the model has a chat template)")
    add_engine_args(gen)
    add_sampling_args(gen)
    from cli.serve_args import add_serve_args

    serve = sub.add_parser(
        "serve", help="serve the OpenAI HTTP API from prefill and decode workers on Ray",
        description="Start (or attach to) Ray, start the prefill and decode workers, and serve the "
                    "OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health, "
                    "/metrics) until Ctrl-C or SIGTERM.",
    )
    add_serve_args(serve)
    from cli.plan import add_plan_args

    plan = sub.add_parser(
        "plan", help="size the KV cache of a model on a device (no model weights are loaded)",
        description="Print KV bytes per token, KV blocks and tokens, and concurrent sequences at a "
                    "context length for MODEL on a device of --device-memory (or a --kv-cache-memory "
                    "budget), with the engine's own sizing formula; then the same budget at every KV "
                    "dtype side by side, with the host/disk offload tiers' blocks when their sizes are "
                    "given.",
    )
    add_plan_args(plan, size, DTYPES)

    from cli.bench import add_bench_parser

    add_bench_parser(sub)
    from cli.profile import add_profile_parser
    from cli.simulate import add_simulate_parser

    add_profile_parser(sub, add_engine_args)
    add_simulate_parser(sub)
    return parser


def _print_output(index: int, total: int, prompt: str, out: RequestOutput) -> None:
    m = out.metrics
    if total > 1:
        print(f"[{index + 1}/{total}] {prompt}")
    print(out.text)
    ttft = f"{m.ttft:.3f} s" if m.ttft is not None else "n/a"
    e2e = m.e2e_latency
    rate = f"{m.output_tokens / e2e:.1f}" if e2e else "n/a"
    cached = f" ({m.cached_prompt_tokens} cached)" if m.cached_prompt_tokens else ""
    print(f"-- prompt tokens: {m.prompt_tokens}{cached}, output tokens: {m.output_tokens}, "
          f"TTFT: {ttft}, output tokens/s: {rate}, finish: {out.finish_reason}")


def run_generate(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args)

    from engine import LLM

    if config.tensor_parallel_size > 1:  # before any rank process starts, naming the flag
        from engine.loader import load_model_source, resolve_model
        from engine.tensor_parallel import check_tp_size

        try:
            check_tp_size(load_model_source(resolve_model(args.model)).config, config.tensor_parallel_size)
        except ValueError as exc:
            raise UsageError(f"--tensor-parallel-size {config.tensor_parallel_size}: {exc}") from None
    llm = LLM(args.model, **dataclasses.asdict(config))
    chat = llm.tokenizer.has_chat_template if args.chat is None else args.chat
    if chat and not llm.tokenizer.has_chat_template:
        raise UsageError("--chat: the model has no chat template")
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(list(args.prompts), params)
    elapsed = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(args.prompts, outputs, strict=True)):
        _print_output(i, len(outputs), prompt, out)
    if len(outputs) > 1:
        produced = sum(o.metrics.output_tokens for o in outputs)
        print(f"-- total: {len(outputs)} prompts, {produced} output tokens in {elapsed:.2f} s "
              f"({produced / elapsed:.1f} output tokens/s)")
    return 0


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from cli.config_file import parse_with_config

    parser = build_parser()
    try:
        args = parse_with_config(parser, argv)
    except (UsageError, ValueError) as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            from cli.serve_config import serve_config_from_args
            from cluster.serve import run_serve

            return run_serve(serve_config_from_args(args), args.config)
        if args.command == "plan":
            from cli.plan import run_plan

            return run_plan(args)
        if hasattr(args, "handler"):
            return int(args.handler(args))
    except (UsageError, ValueError, FileNotFoundError) as exc:
        return _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except TimeoutError as exc:  # a worker's resources could not be reserved
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return _fail(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
