"""``AttentionBackend`` on the Triton kernels of ``kernels/triton_attention.py``.

``prepare`` plans on the host, once per step: the tiles of query rows each program
owns (decode sequences and prefill chunks in tiles of their own ``BLOCK_M``,
``kernels/triton_configs.attention_tiles``; rows are tokens x the query heads of one KV head) and,
for a quantized cache, the touched blocks (block, first and last row written, first
token). ``forward`` then launches the KV write and one attention launch per tile size.
Semantics are the torch reference's (``kernels/torch_ref.py``), quantized caches
included; the tests check both backends against each other.

Per-layer features (``forward``'s ``window``, ``sinks``, ``softcap``; ``features`` names them):
all three run in the attention kernel (``kernels/triton_attention.py``). ``sinks``/``softcap``
select a build, the window is a kernel argument; none touches the step's plan.

``prepare_capture`` (``kernels.attention.CapturableBackend``) plans a pure-decode bucket
for CUDA-graph capture: its tiles depend on the bucket alone, so they are planned once
(by the warm-up forward, before capture) and kept; a quantized cache's block writes
depend on the step, so they are computed on the device from the static metadata tensors
inside every forward (``decode_block_writes``), where a graph captures them. A layer's
window, softcap and sinks tensor are the same at every step, so the launches captured once
(scalars and the sinks' address baked in) stay right.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on
CPU tensors, which is how the CPU-only test suite runs them.
"""

from __future__ import annotations

import math

import torch

from kernels import triton_attention as ta
from kernels import triton_int4 as ti
from kernels.attention import AttentionMetadata
from kernels.triton_configs import (
    MAX_HEAD_DIM,
    WRITE,
    WRITE_INT4,
    KernelLaunch,
    attention_launch,
    interpreting,
    kv_format,
    storage_dtype,
    write_launch,
)


def plan_tiles(query_lens: list[int], q_per_kv: int, decode: bool,
               block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first row) of every tile over the decode (or the prefill) sequences."""
    seqs: list[int] = []
    rows: list[int] = []
    for s, q_len in enumerate(query_lens):
        if (q_len == 1) != decode:
            continue
        for row in range(0, q_len * q_per_kv, block_m):
            seqs.append(s)
            rows.append(row)
    return seqs, rows


def plan_block_writes(meta: AttentionMetadata) -> list[tuple[int, int, int, int]]:
    """(block id, first row, last row, first token) of every block the step writes."""
    out: list[tuple[int, int, int, int]] = []
    bs = meta.block_size
    token = 0
    for q_len, s_len, table in zip(meta.query_lens_list, meta.seq_lens_list, meta.block_tables_list,
                                   strict=True):
        first = s_len - q_len
        for j in range(first // bs, (s_len - 1) // bs + 1):
            lo, hi = max(first, j * bs), min(s_len - 1, (j + 1) * bs - 1)
            out.append((table[j], lo - j * bs, hi - j * bs, token + lo - first))
        token += q_len
    return out


def decode_block_writes(meta: AttentionMetadata) -> torch.Tensor:
    """``plan_block_writes`` of a pure-decode step as an int32 ``[4, num_seqs]`` tensor, computed on the
    metadata's device from ``seq_lens`` and ``block_tables`` alone (no host lists: capturable)."""
    bs = meta.block_size
    last = meta.seq_lens.to(torch.int64) - 1
    page = torch.div(last, bs, rounding_mode="floor").unsqueeze(1)
    blocks = meta.block_tables.to(torch.int64).gather(1, page).squeeze(1)
    rows = last % bs
    tokens = torch.arange(last.shape[0], dtype=torch.int64, device=last.device)
    return torch.stack([blocks, rows, rows, tokens]).to(torch.int32)


NO_WINDOW = 1 << 30  # the kernel's ``window`` for a layer without one: more keys than any sequence has


def check_features(num_heads: int, device: torch.device, window: int | None, sinks: torch.Tensor | None,
                   softcap: float | None) -> None:
    """Raise ``ValueError`` naming a per-layer feature argument that breaks the interface's contract."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys per query, itself included), got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.dtype != torch.float32
                              or sinks.device != device):
        raise ValueError(f"sinks must be float32 [{num_heads}] (one per query head) on {device}, "
                         f"got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


class TritonAttentionBackend:
    """Paged attention and KV writes in Triton (CUDA, or the interpreter on CPU)."""

    features: frozenset[str] = frozenset({"window", "sinks", "softcap"})

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._tiles: dict[tuple[int, bool, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._writes: torch.Tensor | None = None
        self._interpret = interpreting()
        self._static = False

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._tiles = {}
        self._writes = None
        self._static = False

    def capture_instance(self) -> TritonAttentionBackend:
        return TritonAttentionBackend()

    def prepare_capture(self, meta: AttentionMetadata) -> None:
        """Plan a pure-decode bucket whose metadata tensors are static buffers (see the module docstring)."""
        if not meta.is_pure_decode:
            raise ValueError("prepare_capture takes pure-decode steps only (every query one token)")
        self.prepare(meta)
        self._static = True

    def prepare_replay(self, meta: AttentionMetadata) -> None:
        """Nothing: a bucket's tiles never change, and its block writes are computed in the graph."""

    def _tiles_for(self, q_per_kv: int, decode: bool, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (q_per_kv, decode, block_m)
        if key not in self._tiles:
            assert self._meta is not None
            seqs, rows = plan_tiles(self._meta.query_lens_list, q_per_kv, decode, block_m)
            both = torch.tensor([seqs, rows], dtype=torch.int32).to(self._meta.seq_lens.device)
            self._tiles[key] = (both[0], both[1])
        return self._tiles[key]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("TritonAttentionBackend.forward called before prepare")
        check_features(q.shape[1], q.device, window, sinks, softcap)
        fmt = kv_format(kv_layer.dtype)
        if q.shape[2] > MAX_HEAD_DIM:
            raise ValueError(f"the Triton backend supports head_dim <= {MAX_HEAD_DIM}, got {q.shape[2]}")
        if fmt.quantized and kv_scales is None:
            raise ValueError(f"a {kv_layer.dtype} KV cache needs its scales")
        model_dtype = q.dtype
        head_dim = q.shape[2]
        kv_heads = kv_layer.shape[3]
        q_per_kv = q.shape[1] // kv_heads
        cache = kv_layer.view(storage_dtype(kv_layer.dtype))
        scales = kv_scales if kv_scales is not None else torch.zeros(1, 1, 1, device=q.device)
        self._write(k, v, cache, scales, write_launch(model_dtype, kv_layer.dtype, head_dim, meta.block_size))
        out = torch.empty_like(q)
        cap = softcap or 1.0
        for decode in (True, False):
            cfg = attention_launch(model_dtype, kv_layer.dtype, head_dim, decode, self._interpret,
                                   sinks=sinks is not None, softcap=softcap is not None)
            tile_seq, tile_row = self._tiles_for(q_per_kv, decode, int(cfg.constexprs["BLOCK_M"]))
            if tile_seq.numel() == 0:
                continue
            ta.paged_attention_kernel[(tile_seq.numel(), kv_heads)](
                q, k, v, cache, scales, out, sinks if sinks is not None else scales,
                meta.block_tables, meta.query_start_loc, meta.seq_lens, tile_seq, tile_row,
                scale * math.log2(math.e), scale / cap, cap * math.log2(math.e), window or NO_WINDOW,
                q_per_kv, meta.block_size,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), meta.block_tables.stride(0),
                *cache.stride()[:4], scales.stride(0), scales.stride(1),
                num_warps=cfg.num_warps, **cfg.constexprs,
            )
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
               cfg: KernelLaunch) -> None:
        meta = self._meta
        assert meta is not None
        kv_heads = cache.shape[3]
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), *cache.stride()[:4])
        if cfg.kernel == WRITE:
            if k.shape[0]:
                ta.write_kv_kernel[(k.shape[0], kv_heads)](
                    k, v, cache, meta.slot_mapping, meta.block_size, *strides,
                    num_warps=cfg.num_warps, **cfg.constexprs,
                )
            return
        if self._static:
            self._writes = decode_block_writes(meta)
        elif self._writes is None:
            plan = plan_block_writes(meta)
            self._writes = torch.tensor(plan, dtype=torch.int32).reshape(-1, 4).t().contiguous().to(k.device)
        writes = self._writes
        if writes.shape[1] == 0:
            return
        kernel = ti.write_kv_int4_kernel if cfg.kernel == WRITE_INT4 else ta.write_kv_quantized_kernel
        kernel[(writes.shape[1], kv_heads)](
            k, v, cache, scales, writes[0], writes[1], writes[2], writes[3],
            *strides, scales.stride(0), scales.stride(1),
            num_warps=cfg.num_warps, **cfg.constexprs,
        )
