"""``pdserve profile``'s measurements: a worker's engine and a NIXL transfer, on the machine it runs on.

The engine is the one a worker builds (``LLMEngine`` with the same ``EngineConfig``, ``torch_threads``
torch threads, as ``--torch-threads`` gives each worker), in this process:

- prefill: one step computing a prompt of ``new`` tokens after ``cached`` tokens of prefix-cache hit;
  each point is the median of ``repeats`` steps over fresh random prompts (no accidental cache hits);
- decode: ``batch`` requests (at most the engine's ``max_num_seqs``) of ``context`` distinct random
  tokens each, then the median of ``steps`` decode steps with every request running; the sample's
  context is the tokens the batch holds at the middle step;
- transfer: a ``KvSink.read_blocking`` of ``n`` blocks of this model's KV layout from a ``KvSource``
  in the same process (NIXL over UCX, as between two workers on one host), median of ``repeats``.

Prompts whose K/V only has to be in place (a decode batch, a cached prefix) are placed as a decode
worker places a transferred prompt (``reserve`` + ``start_prefilled``): their blocks are held and
hashed but not computed, since a step's time does not depend on the values, so large batches cost no
setup time.

Each kind is then fitted (``planner.fit``). The grid is small with ``quick`` (under a minute for the
default model on two cores) and wider without. Only the points that fit in the KV cache are run.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from planner.fit import fit_decode, fit_prefill, fit_transfer
from planner.profile import (
    DecodeSample,
    MachineInfo,
    ModelInfo,
    PrefillSample,
    Profile,
    TransferSample,
)
from transfer.compat import compat_hash
from transfer.nixl_sink import KvSink
from transfer.nixl_source import KvSource
from transfer.wire import KvHandle, KvLayout

DEFAULT_REQUEST_OVERHEAD_S = 0.02


@dataclass(frozen=True)
class Grid:
    prefill: tuple[tuple[int, int], ...]  # (new tokens, cached tokens)
    decode: tuple[tuple[int, int], ...]  # (batch, context tokens per request)
    transfer_blocks: tuple[int, ...]
    repeats: int
    steps: int


QUICK = Grid(prefill=((16, 0), (64, 0), (256, 0), (512, 0), (64, 512), (256, 256)),
             decode=((1, 128), (2, 256), (3, 256), (4, 1024), (8, 128), (8, 512), (16, 512), (32, 128),
                     (32, 256)),
             transfer_blocks=(1, 8, 64, 256), repeats=2, steps=5)
FULL = Grid(prefill=((16, 0), (32, 0), (64, 0), (128, 0), (256, 0), (512, 0), (1024, 0), (2048, 0),
                     (64, 512), (256, 512), (128, 1024), (512, 1024), (256, 1536)),
            decode=((1, 64), (1, 1024), (2, 256), (3, 512), (4, 256), (8, 128), (8, 1024), (16, 256),
                    (32, 128), (32, 512), (64, 128), (64, 256), (128, 64)),
            transfer_blocks=(1, 4, 16, 64, 256, 1024), repeats=3, steps=8)

Progress = Callable[[str], None]


def _prompt(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def _run(engine: LLMEngine, prompt: list[int], max_tokens: int, rid: str) -> float:
    """Add a request and step until it finished; the seconds of those steps."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    engine.add_request(prompt, params, request_id=rid)
    start = time.perf_counter()
    while rid in engine.requests:
        engine.step()
    return time.perf_counter() - start


def _place(engine: LLMEngine, prompt: list[int], rid: str, max_tokens: int) -> bool:
    """Put a request in the KV cache as if its prompt had arrived from a prefill worker (a decode
    worker's ``reserve`` + ``start_prefilled``): its blocks are held and hashed, their values are not
    computed (a step's time does not depend on them). False when the cache has no room."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    if engine.reserve(engine.make_request(prompt, params, request_id=rid)) is None:
        return False
    engine.start_prefilled(rid, prompt[-1])
    return True


def measure_prefill(engine: LLMEngine, grid: Grid, progress: Progress) -> list[PrefillSample]:
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    room = engine.kv.num_blocks * engine.kv.block_size
    _run(engine, _prompt(gen, vocab, 32), 1, "warmup")
    out = []
    for new, cached in grid.prefill:
        if new > budget or new + cached + 1 > room:
            continue
        times: list[float] = []
        for rep in range(grid.repeats):
            prefix = _prompt(gen, vocab, cached)
            if cached:  # the prefix's blocks, cached: placed, then released (they stay in the prefix cache)
                _place(engine, prefix, f"p-prefix-{new}-{cached}-{rep}", 2)
                engine.abort_request(f"p-prefix-{new}-{cached}-{rep}")
            times.append(_run(engine, prefix + _prompt(gen, vocab, new), 1, f"p-{new}-{cached}-{rep}"))
        out.append(PrefillSample(new, cached, statistics.median(times)))
        progress(f"prefill {new} tokens after {cached} cached: {out[-1].seconds * 1000:.1f} ms")
    return out


def measure_decode(engine: LLMEngine, grid: Grid, progress: Progress) -> list[DecodeSample]:
    gen = torch.Generator().manual_seed(2)
    vocab = engine.model_config.vocab_size
    room = engine.kv.num_blocks * engine.kv.block_size
    out = []
    seen: set[tuple[int, int]] = set()
    for batch, context in grid.decode:
        batch = min(batch, engine.config.max_num_seqs)  # the largest batch this engine runs
        if (batch, context) in seen or batch * (context + grid.steps + 32) > 0.9 * room:
            continue
        seen.add((batch, context))
        ids = [f"d-{batch}-{context}-{i}" for i in range(batch)]
        placed = [rid for rid in ids if _place(engine, _prompt(gen, vocab, context), rid, 10**6)]
        engine.step()  # the first step with this batch (buffers sized), untimed
        times: list[float] = []
        held: list[int] = []
        for _ in range(grid.steps):
            held.append(sum(engine.requests[r].num_tokens for r in placed))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        for rid in placed:
            engine.abort_request(rid)
        out.append(DecodeSample(len(placed), int(statistics.median(held)), statistics.median(times)))
        progress(f"decode batch {len(placed)} x {context} context: {out[-1].seconds * 1000:.1f} ms/step")
    return out


def measure_transfer(engine: LLMEngine, grid: Grid, progress: Progress) -> list[TransferSample]:
    kv = engine.runner.kv_cache
    _, _, _, block_size, kv_heads, head_dim = kv.shape
    blocks = max(grid.transfer_blocks)
    layout = KvLayout(engine.model_config.name, str(kv.dtype).removeprefix("torch."), kv.shape[0], blocks,
                      block_size, kv_heads, head_dim, kv.element_size())
    tag = uuid.uuid4().hex[:8]
    src = torch.ones(layout.shape, dtype=kv.dtype, device=kv.device)
    dst = torch.zeros(layout.shape, dtype=kv.dtype, device=kv.device)
    source = KvSource(src, layout, f"profile-src-{tag}")
    sink = KvSink(dst, layout, f"profile-dst-{tag}")
    out = []
    try:
        sink.connect(source.agent_info())
        # one read of every block first: UCX's first transfers set up registrations and queues, and a
        # small size measured cold can outlast the largest one, hiding the cost per byte
        warm = KvHandle("t-warm", source.agent_name, list(range(blocks)), blocks * block_size,
                        compat_hash(layout), time.time() + 60)
        source.add_lease(warm.request_id, warm.lease_deadline)  # as a prefill worker holds one
        sink.read_blocking(warm, list(range(blocks)), list(range(blocks)), timeout=30.0)
        source.poll()
        for n in grid.transfer_blocks:
            times = []
            for rep in range(grid.repeats + 1):
                handle = KvHandle(f"t-{n}-{rep}", source.agent_name, list(range(n)), n * block_size,
                                  compat_hash(layout), time.time() + 60)
                source.add_lease(handle.request_id, handle.lease_deadline)
                stats = sink.read_blocking(handle, list(range(n)), list(range(n)), timeout=30.0)
                source.poll()
                if rep:  # the first read of a size warms the path
                    times.append(stats.seconds)
            nbytes = n * layout.num_layers * layout.region_bytes
            out.append(TransferSample(nbytes, statistics.median(times)))
            progress(f"transfer {n} blocks ({nbytes / 2**20:.1f} MiB): {out[-1].seconds * 1000:.2f} ms")
    finally:
        sink.close()
        source.close()
    return out


def chat_overheads(engine: LLMEngine) -> tuple[int, int, int]:
    """(tokens a template adds to a lone user message, to a system + user pair, leading tokens every
    lone-user prompt shares); zeros without a chat template."""
    tok = engine.tokenizer
    if not tok.has_chat_template:
        return 0, 0, 0
    a = tok.apply_chat_template([{"role": "user", "content": "alpha"}])
    b = tok.apply_chat_template([{"role": "user", "content": "omega"}])
    both = tok.apply_chat_template([{"role": "system", "content": "alpha"},
                                    {"role": "user", "content": "beta"}])
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    user = len(a) - len(tok.encode("alpha"))
    system = len(both) - len(tok.encode("alpha")) - len(tok.encode("beta"))
    return user, system, shared


def run_profile(model: str | None, config: EngineConfig, *, quick: bool, torch_threads: int,
                request_overhead_s: float = DEFAULT_REQUEST_OVERHEAD_S,
                progress: Progress = lambda _: None, grid: Grid | None = None) -> Profile:
    """Measure and fit a profile of one worker's engine and a transfer on this machine (on ``grid``, by
    default ``QUICK`` or ``FULL``)."""
    torch.set_num_threads(torch_threads)
    grid = grid or (QUICK if quick else FULL)
    started = time.perf_counter()
    engine = LLMEngine(model, config)
    progress(f"model loaded in {time.perf_counter() - started:.1f} s")
    prefill = measure_prefill(engine, grid, progress)
    decode = measure_decode(engine, grid, progress)
    transfer = measure_transfer(engine, grid, progress)
    kv = engine.runner.kv_cache
    layers, block_size = kv.shape[0], kv.shape[3]
    per_block = layers * (kv.shape[2] * block_size * kv.shape[4] * kv.shape[5] * kv.element_size())
    user, system, shared = chat_overheads(engine)
    cfg = engine.config
    return Profile(
        machine=MachineInfo(socket.gethostname(), platform.platform(),
                            platform.processor() or platform.machine(),
                            os.cpu_count() or 1, cfg.device if cfg.device == "cpu" else
                            torch.cuda.get_device_name(torch.device(cfg.device)), torch_threads),
        model=ModelInfo(engine.model_config.name,
                        "bfloat16" if cfg.bf16_products else str(cfg.torch_dtype).removeprefix("torch."),
                        cfg.kv_cache_dtype, per_block // block_size, block_size,
                        engine.kv.num_blocks * block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                        user, system, shared),
        prefill=fit_prefill(prefill), decode=fit_decode(decode), transfer=fit_transfer(transfer),
        request_overhead_s=request_overhead_s,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=f"pdserve profile{' --quick' if quick else ''}: engine {cfg.linear_kernel} linear kernels, "
              f"{torch_threads} torch thread(s), measured in {time.perf_counter() - started:.0f} s",
        prefill_samples=tuple(prefill), decode_samples=tuple(decode), transfer_samples=tuple(transfer),
    )
