"""The flags that configure an engine, shared by every subcommand that builds one (``generate``,
``serve``, ``profile``): ``add_engine_args`` adds them, ``engine_config_from_args`` reads them back as
the one ``EngineConfig``; and the byte-size flag type (``size``: ``512M``, ``2G``) they and
``pdserve plan`` use."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
from typing import TYPE_CHECKING

from cli.argtypes import converted

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.config import EngineConfig

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "int8", "int4")
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")




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


def format_size(value: int) -> str:
    """A byte count as ``parse_size`` reads it back: the largest binary unit it is a whole number of."""
    for unit in "TGMK":
        if value and value % _SIZE_UNITS[unit] == 0:
            return f"{value // _SIZE_UNITS[unit]}{unit}"
    return str(value)


size = converted(parse_size, format_size)
size_or_zero = converted(functools.partial(parse_size, allow_zero=True), format_size)  # 0 means off




def _device(text: str) -> str:
    if not _DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}; use cpu, cuda or cuda:N")
    return text




def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags that configure an engine (model, memory, scheduler limits). Each flag's dest is
    an ``EngineConfig`` field and its default is that field's default (``engine_config_from_args``)."""
    from engine.config import (
        ATTENTION_BACKENDS,
        GGUF_ACTIVATIONS,
        KV_EVICTION_POLICIES,
        QUANTIZATION_METHODS,
        EngineConfig,
    )
    from engine.spec_config import parse_speculative_config
    from kernels.linear import LINEAR_KERNELS

    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a Hugging Face model folder (config.json, tokenizer, *.safetensors) or a .gguf "
                        "file; default: the built-in SmolLM2-135M-Instruct Q4_1 GGUF in "
                        "$PDSERVE_CACHE/models (fetched by scripts/fetch_model.py)")
    g.add_argument("--dtype", choices=("auto", *DTYPES), default=d.dtype,
                   help="dtype of weights, activations and KV cache; auto is bfloat16 on CUDA, and on CPU "
                        "float32 (a GGUF's Q4, Q5, Q6_K and Q8_0 matrices and an fp8 checkpoint's "
                        "codes staying in their blocks: the same results as float32 under "
                        "--gguf-activations float32), or bfloat16 for a Hugging "
                        "Face checkpoint that names it on a CPU with AVX512-BF16 (logged); an explicit "
                        "dtype dequantizes GGUF blocks. bfloat16 on CPU stores the weights in bfloat16 and "
                        "multiplies them with bfloat16 dot products into float32 sums (AVX512-BF16 where "
                        "the CPU has it; a MoE router stays float32), the activations, norms, attention and "
                        "KV cache staying float32")
    g.add_argument("--gguf-activations", choices=GGUF_ACTIVATIONS, default=d.gguf_activations,
                   help="the activations of the products over a GGUF's blocks kept under "
                        "--dtype auto on CPU: float32 (the dequantized float32 model's results, bitwise) or "
                        "int8 (quantized per 32 inputs, integer dot products with AVX512-VNNI, as llama.cpp "
                        "computes; other results, refused with an explicit --dtype or a CPU without "
                        "avx512_vnni); prefill and decode workers must agree")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=d.quantization,
                   help="the method the checkpoint's quantization_config must name (fp8: e4m3 weights "
                        "with per-tensor, per-channel or block scales; mxfp4: gpt-oss's experts); a "
                        "quantized checkpoint is read whatever this says, its weights dequantized to "
                        "--dtype at load (under --dtype auto on CPU an fp8 checkpoint's dense matrices "
                        "keep their codes for the native product)")
    g.add_argument("--device", type=_device, default=d.device,
                   help="torch device: cpu, cuda or cuda:N")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="KV cache storage: auto (the --dtype), fp8 (e4m3), fp8_e5m2, int8 or int4; fp8 "
                        "and int8 blocks keep float32 per-block, per-head scales and hold 2x the tokens "
                        "of bf16 (4x of float32) per byte; int4 packs two codes a byte with a float32 "
                        "low and step per block, head and 16 channels (3.8x bf16's tokens at head dim "
                        "64, block 16)")
    g.add_argument("--preemption-mode", choices=("recompute", "swap"), default=d.preemption_mode,
                   help="when KV runs out, the least important running request (highest priority value) "
                        "is preempted: recompute its KV on resume, or swap its blocks to host memory and "
                        "back")
    g.add_argument("--swap-space", type=size, default=d.swap_space, metavar="SIZE",
                   help="host memory for swapped-out KV with --preemption-mode swap; requests that do "
                        "not fit are recomputed")
    g.add_argument("--kv-offload-bytes", type=size_or_zero, default=d.kv_offload_bytes, metavar="SIZE",
                   help="host memory for prefix-cache blocks evicted from the KV cache; a later prefix "
                        "hit copies them back instead of recomputing; 0 means off")
    g.add_argument("--kv-offload-dir", default=d.kv_offload_dir, metavar="DIR",
                   help="disk tier below the host tier: one file per block plus an index, kept across "
                        "restarts for the same model and KV layout (default: none)")
    g.add_argument("--kv-offload-disk-bytes", type=size, default=d.kv_offload_disk_bytes, metavar="SIZE",
                   help="most bytes the disk tier (--kv-offload-dir) holds; its least recently used "
                        "block file is deleted past that")
    g.add_argument("--kv-window", type=int, default=d.kv_window, metavar="N",
                   help="bounded KV for endless sessions: keep only the last N tokens' K/V (whole "
                        "blocks) plus the --kv-sinks first tokens; generation is then not limited by "
                        "the pool (default: off; refused beside a model's own sliding-window layers)")
    g.add_argument("--kv-eviction", choices=KV_EVICTION_POLICIES, default=d.kv_eviction,
                   help="keep each sequence within --kv-budget tokens by freeing, before each chunk, whole "
                        "blocks outside the last --kv-recent tokens by the attention they received so far: "
                        "h2o the blocks of least attention summed over every layer and head, headwise those "
                        "no single layer's KV head gives a large share of its attention (the native CPU "
                        "kernels score the blocks; on CUDA the torch kernel does)")
    g.add_argument("--kv-budget", type=int, default=d.kv_budget, metavar="TOKENS",
                   help="with --kv-eviction h2o or headwise: the KV tokens one sequence may hold")
    g.add_argument("--kv-recent", type=int, default=d.kv_recent, metavar="TOKENS",
                   help="with --kv-eviction h2o or headwise: the last tokens never evicted; half the "
                        "budget when not given")
    g.add_argument("--hybrid-kv", action=argparse.BooleanOptionalAction, default=d.hybrid_kv,
                   help="a hybrid model's sliding-window layers keep only the KV blocks their window still "
                        "reads, in KV groups of their own (docs/models.md); --no-hybrid-kv keeps every block")
    g.add_argument("--kv-sinks", type=int, default=d.kv_sinks, metavar="K",
                   help="attention sinks kept with --kv-window: the first K tokens, rounded up to whole "
                        "blocks")
    g.add_argument("--block-size", type=int, default=d.block_size, metavar="N",
                   help="tokens per KV cache block, a power of two")
    g.add_argument("--kv-cache-memory", type=size, default=d.kv_cache_memory, metavar="SIZE",
                   help="bytes for the paged KV cache, with optional K/M/G/T suffix, 1024-based; "
                        "ignored when --num-kv-blocks is given")
    g.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, metavar="N",
                   help="exact number of KV cache blocks (default: derived from --kv-cache-memory)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse KV blocks of identical prompt prefixes across requests")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, metavar="N",
                   help="most tokens (prompt chunks + decodes) run in one engine step")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help="most requests running at once")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, metavar="N",
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--seed", type=int, default=d.seed, metavar="N",
                   help="seed of the engine's random sampling")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                   help="attention kernels: auto (flashinfer on CUDA when installed and the KV cache is "
                        "not quantized, else Triton on CUDA; the CPU kernels on CPU; a latent (MLA) cache "
                        "takes Triton on CUDA for flashinfer too), triton, flashinfer or torch")
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="run the model eagerly: no compiled forward (--compile-cpu), no CUDA graphs")
    g.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default=d.linear_kernel,
                   help="matrix products on CPU: native (one native product for every row count against "
                        "weights packed once at load, replacing the decoder's unpacked ones; prepacked where "
                        "the native kernels cannot be built), prepacked (MKL's product packed for one row, "
                        "oneDNN's to 64 rows, MKL's or oneDNN's SGEMM above; an extra copy of the weights), "
                        "plain (torch's F.linear) or triton (kept quantized blocks through the Triton "
                        "product, as CUDA devices always run them; on CPU only under TRITON_INTERPRET=1)")
    g.add_argument("--compile-cpu", action=argparse.BooleanOptionalAction, default=d.compile_cpu,
                   help="compile the decoder layers with torch.compile (inductor) for decode batches padded "
                        "to buckets, cached on disk under $PDSERVE_CACHE/inductor; it did not pay on the "
                        "CPUs measured, see docs/cpu_engine.md")
    g.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=d.native_kernels,
                   help="the native CPU kernels (attention, products, fused ops); off: torch's ops, MKL's "
                        "packed products and the torch attention")
    g.add_argument("--native-decoder", action=argparse.BooleanOptionalAction, default=d.native_decoder,
                   help="every layer of a plain Llama-family step in one native call (docs/cpu_engine.md)")
    g.add_argument("--greedy-head", action=argparse.BooleanOptionalAction, default=d.greedy_head,
                   help="greedy rows' tokens from a half-precision screen of the LM head, rechecked exactly")
    g.add_argument("--large-product", choices=("auto", "mkl", "onednn"), default=d.large_product,
                   help="the product of prompt chunks under --linear-kernel prepacked: MKL's or oneDNN's "
                        "(auto: MKL's on Intel CPUs, oneDNN's on others)")
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
                        "roles unless --prefill-tp / --decode-tp say otherwise")
    g.add_argument("--tp-timeout", dest="tp_timeout_s", type=float, default=d.tp_timeout_s, metavar="SECONDS",
                   help="with --tensor-parallel-size above 1, the longest any collective of the rank group "
                        "waits: a dead or hung rank is an error after it, never a hang")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization, metavar="F",
                   help="with --device cuda, the fraction of the device's memory the engine may use "
                        "(weights plus KV cache), in (0, 1]")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the flags added by :func:`add_engine_args` (each dest names its field;
    fields without a flag keep their defaults). Raises ValueError naming the flag on a bad value."""
    from engine.config import EngineConfig

    given = dict(vars(args))
    for name, (field, value) in _deprecated_env().items():
        if field in given and given[field] == getattr(EngineConfig, field):
            logger.warning("%s is deprecated: use --%s", name, field.replace("_", "-"))
            given[field] = value
    return EngineConfig(**{f.name: given[f.name] for f in dataclasses.fields(EngineConfig)
                           if f.name in given})


def _deprecated_env() -> dict[str, tuple[str, object]]:
    """The environment variables that once set engine switches: variable -> (field, value). Read here
    once, where no flag says otherwise; the engine never reads the environment."""
    off = ("0", "false", "no", "off")
    found: dict[str, tuple[str, object]] = {}
    switches = (("PDSERVE_NATIVE_KERNELS", "native_kernels"), ("PDSERVE_NATIVE_DECODER", "native_decoder"),
                ("PDSERVE_GREEDY_HEAD", "greedy_head"))
    for name, field in switches:
        value = os.environ.get(name)
        if value is not None:
            found[name] = (field, value.strip().lower() not in off)
    product = os.environ.get("PDSERVE_LARGE_PRODUCT")
    if product:
        found["PDSERVE_LARGE_PRODUCT"] = ("large_product", product)
    return found
