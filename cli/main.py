"""The ``pdserve`` command line.

``pdserve generate PROMPT...`` runs prompts through the in-process engine and
prints each completion with its token counts and timings. The engine flags are
defined once in ``cli.engine_args`` so every subcommand that builds an engine
accepts the same ones.

In-process engines (``generate``, ``profile``) read their weights through 2 MB pages, as the serving
workers do (``THP_MEM_ALLOC_ENABLE``, set at import here, before anything imports torch; an explicit
value wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from cli.argtypes import DefaultsHelpFormatter
from cli.engine_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.sampling import SamplingParams

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # see the module doc; torch is not imported yet

PROG = "pdserve"


class UsageError(Exception):
    """A bad command line; its message names the flag."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``pdserve: error: ...``) and whose help shows each
    option's default from the parser (``cli.argtypes.DefaultsHelpFormatter``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


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


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``engine.SamplingParams``."""
    g = parser.add_argument_group("sampling")
    penalty = _number(float, -2.0, 2.0, what="in [-2, 2]")
    g.add_argument("--max-tokens", type=_number(int, 1, what=">= 1"), default=64, metavar="N",
                   help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=_number(float, 0.0, what=">= 0"), default=0.0, metavar="T",
                   help="sampling temperature; 0 means greedy")
    g.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True, what="in (0, 1]"),
                   default=1.0, metavar="P",
                   help="keep the smallest set of tokens whose probability sums to P; 1 means off")
    g.add_argument("--top-k", type=_number(int, 0, what=">= 0"), default=0, metavar="K",
                   help="keep only the K most likely tokens; 0 means off")
    g.add_argument("--min-p", type=_number(float, 0.0, 1.0, what="in [0, 1]"), default=0.0, metavar="P",
                   help="drop tokens less likely than P x the top token's probability; 0 means off")
    g.add_argument("--presence-penalty", type=penalty, default=0.0, metavar="X",
                   help="subtract this from the logit of every token already generated")
    g.add_argument("--frequency-penalty", type=penalty, default=0.0, metavar="X",
                   help="subtract this x its count from the logit of each generated token")
    g.add_argument("--repetition-penalty", type=_number(float, 0.0, low_open=True, what="> 0"),
                   default=1.0, metavar="X",
                   help="divide positive (multiply negative) logits of tokens seen in the prompt or "
                        "output by this; 1 means off")
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
    from cli.plan_cmd import add_plan_args

    plan = sub.add_parser(
        "plan", help="size the KV cache of a model on a device (no model weights are loaded)",
        description="Print KV bytes per token, KV blocks and tokens, and concurrent sequences at a "
                    "context length for MODEL on a device of --device-memory (or a --kv-cache-memory "
                    "budget), with the engine's own sizing formula; then the same budget at every KV "
                    "dtype side by side, with the host/disk offload tiers' blocks when their sizes are "
                    "given.",
    )
    add_plan_args(plan)

    from cli.bench import add_bench_parser

    add_bench_parser(sub)
    from cli.profile import add_profile_parser
    from cli.simulate import add_simulate_parser

    add_profile_parser(sub)
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
            from cli.plan_cmd import run_plan

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
