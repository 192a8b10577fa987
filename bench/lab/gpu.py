"""Single-GPU engine benchmark, no Ray and no HTTP: ``python -m bench.lab.gpu [--backend NAME]``.

Prints the GPU, driver and library versions, then on a Llama-3-8B-shaped model with random
bf16 weights (no download):

* decode tokens/s at batch 1, 16, 64 and 256 with 1024 tokens of context each, against the
  HBM roofline ``(weight bytes + KV bytes read) / bandwidth`` (the step's lower bound),
  run eagerly and, when the backend can be captured (Triton), replayed from the engine's CUDA
  graphs (``engine/graph_runner.py``: the step padded into static buffers, one graph per bucket);
* prefill tokens/s and MFU for one 8192-token prompt (``2 x params x tokens / peak FLOP/s``);
* transformers' static-cache ``generate`` at batch 1 on the same shapes, side by side;
* NIXL READ between two processes' CUDA KV caches (VRAM to VRAM over UCX) against the device's
  own ``copy_`` of the same bytes: ``python -m bench.lab.transfer --device cuda``, run as a child
  process at the end (``--no-transfer`` leaves it out).

Peak figures default to an H100 SXM (3.35 TB/s, 989 bf16 TFLOP/s); pass ``--hbm-gbs`` and
``--peak-tflops`` for another part. Has not yet run on a GPU (README.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig, RopeScaling
from engine.graph_runner import DecodeGraphRunner, graph_mode
from engine.kv_tensors import allocate_kv_cache
from engine.models.causal_lm import CausalLM
from engine.tp_group import StepPlan
from kernels import get_attention_backend
from kernels.attention import AttentionMetadata

LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=8192, rope_scaling=RopeScaling(), name="llama-3-8b-shaped",
)
BLOCK_SIZE = 16


def versions() -> dict[str, str]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "gpu": gpu}
    for lib in ("triton", "flashinfer-python", "transformers", "nixl", "gguf", "msgspec"):
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = "not installed"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=False, timeout=30)
        out["driver"] = smi.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        out["driver"] = "no nvidia-smi"
    return out


def random_model(config: ModelConfig, device: str = "cuda") -> CausalLM:
    model = CausalLM(config, torch.bfloat16, device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call, after one warm-up call (synchronized when CUDA is there)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def decode_step(model: CausalLM, kv: torch.Tensor, backend_name: str, batch: int,
                ctx: int, device: str = "cuda") -> Callable[[], object]:
    blocks = -(-(ctx + 1) // BLOCK_SIZE)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    meta = AttentionMetadata.build(BLOCK_SIZE, [1] * batch, [ctx + 1] * batch, tables, device)
    backend = get_attention_backend(device, backend_name)
    ids = torch.zeros(batch, dtype=torch.int64, device=device)
    pos = torch.full((batch,), ctx, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def step() -> object:
        backend.prepare(meta)
        return model.compute_logits(model(ids, pos, kv, backend, meta))

    return step


def graphed_decode_step(model: CausalLM, kv: torch.Tensor, backend_name: str, batch: int,
                        ctx: int, device: str = "cuda") -> Callable[[], object] | None:
    """``decode_step`` through the engine's decode graphs (None when the backend cannot be captured);
    ``kv``'s last block is their scratch block."""
    blocks = -(-(ctx + 1) // BLOCK_SIZE)
    config = EngineConfig(device=device, dtype="bfloat16", attention_backend=backend_name,
                          block_size=BLOCK_SIZE, max_num_seqs=batch)
    backend = get_attention_backend(device, backend_name)
    if graph_mode(config, backend) != "capture":
        return None
    runner = DecodeGraphRunner(model, kv, None, config, "capture", blocks, backend)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    plan = StepPlan([0] * batch, [ctx] * batch, [1] * batch, [ctx + 1] * batch, tables, list(range(batch)))

    @torch.inference_mode()
    def step() -> object:
        rows = runner.execute(plan)
        return None if rows is None else model.compute_logits(rows)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--hbm-gbs", type=float, default=3350.0)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--no-transfer", dest="transfer", action="store_false",
                        help="leave out the NIXL VRAM-to-VRAM READ comparison")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.lab.gpu: no CUDA device here; nothing to measure", file=sys.stderr)
        return 2
    for name, value in versions().items():
        print(f"{name}: {value}")
    config = LLAMA3_8B
    model = random_model(config)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = params * 2
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.ctx + 1) // BLOCK_SIZE)
    blocks_needed = max(max(batches) * per_seq, -(-args.prefill_tokens // BLOCK_SIZE))
    kv = allocate_kv_cache(config, blocks_needed + 1, BLOCK_SIZE, torch.bfloat16, "cuda")  # + scratch
    kv_per_token = config.kv_bytes_per_token(2)
    print(f"model: {config.name}, {params / 1e9:.2f} B params, backend {args.backend}")
    for batch in batches:
        floor = (weight_bytes + batch * (args.ctx + 1) * kv_per_token) / (args.hbm_gbs * 1e9)
        steps = {"eager": decode_step(model, kv, args.backend, batch, args.ctx),
                 "graphs": graphed_decode_step(model, kv, args.backend, batch, args.ctx)}
        for how, step in steps.items():
            if step is None:
                print(f"decode batch {batch:4d}: no CUDA graphs with backend {args.backend}")
                continue
            seconds = cuda_time(step, repeats=10)
            print(f"decode batch {batch:4d} ctx {args.ctx} {how:6s}: {batch / seconds:9.1f} tok/s, "
                  f"step {seconds * 1e3:7.2f} ms, roofline {floor * 1e3:6.2f} ms ({floor / seconds:.0%})")
    n = args.prefill_tokens
    seconds = prefill_seconds(model, kv, args.backend, n)
    mfu = 2 * params * n / seconds / (args.peak_tflops * 1e12)
    print(f"prefill {n} tokens: {n / seconds:9.1f} tok/s, {seconds * 1e3:.1f} ms, MFU {mfu:.0%}")
    del model, kv
    torch.cuda.empty_cache()
    rate = transformers_decode(config, args.ctx)
    print(f"transformers static-cache generate, batch 1 (its {args.ctx}-token prefill in): {rate:.1f} tok/s")
    if args.transfer:
        sys.stdout.flush()
        done = subprocess.run([sys.executable, "-m", "bench.lab.transfer", "--device", "cuda",
                               "--repeats", "5"], timeout=600, check=False)
        if done.returncode:
            print(f"bench.lab.transfer --device cuda failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
    return 0


def prefill_seconds(model: CausalLM, kv: torch.Tensor, backend_name: str, n: int,
                    device: str = "cuda") -> float:
    meta = AttentionMetadata.build(BLOCK_SIZE, [n], [n], [list(range(-(-n // BLOCK_SIZE)))], device)
    backend = get_attention_backend(device, backend_name)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)

    @torch.inference_mode()
    def prefill() -> object:
        backend.prepare(meta)
        return model(ids, pos, kv, backend, meta)

    return cuda_time(prefill, repeats=3)


def transformers_decode(config: ModelConfig, ctx: int, new_tokens: int = 64, device: str = "cuda") -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, max_position_embeddings=config.max_position_embeddings,
    ))
    hf = hf.to(device=device, dtype=torch.bfloat16).eval()  # type: ignore[call-arg]
    prompt = torch.zeros(1, ctx, dtype=torch.int64, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static")
    return new_tokens / cuda_time(lambda: hf.generate(prompt, **kwargs), repeats=1)


if __name__ == "__main__":
    sys.exit(main())
