"""Fused mixture-of-experts in Triton: a grouped GEMM over token-expert pairs sorted by expert.

``triton_fused_moe`` computes ``kernels/moe.py``'s contract in three launches:

1. ``moe_align`` (torch ops, no host synchronisation, shapes fixed by ``T``, ``k``, ``E`` and
   ``BLOCK_M``, so a CUDA graph captures it): the flat pair index ``t * k + j`` of every pair
   with an expert, grouped by expert, each expert's run padded to a multiple of ``BLOCK_M``
   with the sentinel ``T * k``; the expert of every ``BLOCK_M`` block; the padded total.
   Pairs with id ``-1`` are left out. The buffer is sized for the worst case,
   ``T*k + min(E, T*k) * (BLOCK_M - 1)``, and programs past the padded total return at once,
   so an expert with no token costs nothing and ``T = 1`` launches few live programs.
2. ``moe_gemm_kernel`` with ``GATED``: one program per (block of pairs, block of ``I``
   columns) gathers its tokens' rows of ``x``, multiplies them by the gate and the up rows
   of its expert's ``w13`` (two float32 accumulators), adds ``b13`` and applies the
   activation, and stores ``a`` (``[T*k, I]``, ``x``'s dtype) at the pairs' rows.
3. ``moe_gemm_kernel`` without ``GATED``: ``a @ w2[e]^T + b2[e]``, times the pair's routing
   weight, stored at the pair's row of ``y`` (``[T*k, H]``); then ``moe_sum_kernel`` adds each
   token's ``k`` rows in float32 (skipping ``-1`` pairs, whose rows were never written) into
   the output in ``x``'s dtype.

Block programs are ordered in groups of ``GROUP_M`` pair blocks so that neighbouring
programs share weight tiles in L2. Dots run in float32 (``DOT_FP32``: ``input_precision
="ieee"``) for float32 weights and under the interpreter (whose 16-bit ``tl.dot`` is wrong),
else 16-bit operands with float32 accumulation, as in ``kernels/triton_attention.py``.
Tile sizes and warps: ``kernels/triton_configs.moe_launch``, checked spill-free for sm_80
and sm_90 by ``kernels/triton_aot.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import MoeActivation, check_moe_args
from kernels.triton_configs import interpreting, moe_launch, moe_sum_launch


@triton.jit
def _activate(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """``kernels.moe.MoeActivation`` in float32; ``ACTIVATION`` is its ``code``."""
    if ACTIVATION == 0:  # silu
        return gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:  # swiglu_oai
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:  # gelu_tanh: 0.5 * (1 + tanh(u)) == sigmoid(2u)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return gate * tl.sigmoid(2.0 * u) * up


@triton.jit
def moe_gemm_kernel(
    a_ptr, w_ptr, b_ptr, weights_ptr, out_ptr, pairs_ptr, block_expert_ptr, padded_ptr,
    num_pairs, row_div, num_blocks_m, n_cols, k_dim, alpha, limit,
    stride_at, stride_we, stride_wn, stride_be, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """``out[pair, n] = f(a[pair // row_div] @ w[e]^T)`` for the pairs of one block (module docstring).

    ``GATED``: ``w`` is ``w13`` and ``n`` runs over ``I = n_cols`` (gate row ``n``, up row
    ``I + n``), ``f`` is bias then activation. Otherwise ``w`` is ``w2``, ``f`` is bias then the
    routing weight. ``a`` and ``w`` are contiguous along ``k_dim``."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    row_ok = pair < num_pairs
    a_rows = (pair // row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_cols
    w_cols = offs_n % n_cols  # columns past the edge reread valid ones, never stored: no mask
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (a_rows[:, None] * stride_at + offs_k[None, :])
    w_ptrs = (w_ptr + expert * stride_we) + (w_cols[None, :] * stride_wn + offs_k[:, None])  # int32 in-tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if GATED:
            w_up = tl.load(w_ptrs + n_cols * stride_wn, mask=k_ok[:, None], other=0.0)
        # inline, not a helper: each call of a jitted helper costs the interpreter milliseconds
        if DOT_FP32:
            a = a.to(tl.float32)
            acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
            if GATED:
                acc_up += tl.dot(a, w_up.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
            if GATED:
                acc_up += tl.dot(a, w_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        bias_ptrs = b_ptr + expert * stride_be + offs_n
        acc += tl.load(bias_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptrs + n_cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _activate(acc, acc_up, alpha, limit, ACTIVATION)
    else:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_sum_kernel(y_ptr, ids_ptr, out_ptr, tokens, hidden, top_k, stride_yt, stride_ot,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_j y[t * top_k + j]`` in float32 over the pairs whose id is not ``-1``, for a
    ``BLOCK_T`` x ``BLOCK_H`` tile of the output."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < tokens
    ok = t_ok[:, None] & (h < hidden)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in range(0, top_k):
        pair = t.to(tl.int64) * top_k + j
        live = tl.load(ids_ptr + pair, mask=t_ok, other=-1) >= 0
        y = tl.load(y_ptr + pair[:, None] * stride_yt + h[None, :], mask=ok & live[:, None], other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs ``int32 [P]``, expert of each block ``int32 [P / block_m]`` (-1 past the end), padded
    total ``int32 [1]``) for ``topk_ids`` ``[T, k]``; device ops only (module docstring, step 1)."""
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    device = flat.device
    size = numel + min(num_experts, numel) * (block_m - 1)
    size = -(-size // block_m) * block_m
    bins = torch.where(flat >= 0, flat, num_experts)  # "no expert" sorts into a bin past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    padded = torch.div(counts[:num_experts] + block_m - 1, block_m, rounding_mode="floor") * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(bins, stable=True)
    sorted_bins = bins[order]
    first_of_bin = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel, device=device) - first_of_bin[sorted_bins]
    bin_start = torch.cat((ends - padded, torch.full((1,), size, dtype=torch.int64, device=device)))
    dest = torch.where(sorted_bins < num_experts, bin_start[sorted_bins] + rank, size)
    pairs = torch.full((size + 1,), numel, dtype=torch.int32, device=device)
    pairs.scatter_(0, dest, order.to(torch.int32))  # "no expert" pairs all land on the last slot, dropped
    block_start = torch.arange(0, size, block_m, device=device)
    expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return pairs[:size], block_expert, ends[-1:].to(torch.int32)


def triton_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: MoeActivation, b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.moe.fused_moe_reference``'s result, in the three launches of the module docstring."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, b13, b2)
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    topk_ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    num_pairs = tokens * top_k
    interpret = interpreting()
    steps = [moe_launch(x.dtype, tokens, experts, gated, activation.code, bias is not None, interpret)
             for gated, bias in ((True, b13), (False, b2))]
    block_m = int(steps[0].constexprs["BLOCK_M"])
    assert steps[1].constexprs["BLOCK_M"] == block_m
    pairs, block_expert, padded = moe_align(topk_ids, experts, block_m)
    blocks_m = block_expert.numel()
    a = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    bias13 = b13.contiguous() if b13 is not None else w13
    bias2 = b2.contiguous() if b2 is not None else w2
    for cfg, src, w, bias, dst, row_div, n_cols, k_dim in (
        (steps[0], x, w13, bias13, a, top_k, inter, hidden),
        (steps[1], a, w2, bias2, y, 1, hidden, inter),
    ):
        grid = (blocks_m * triton.cdiv(n_cols, int(cfg.constexprs["BLOCK_N"])),)
        moe_gemm_kernel[grid](
            src, w, bias, weights, dst, pairs, block_expert, padded,
            num_pairs, row_div, blocks_m, n_cols, k_dim, activation.alpha, activation.limit,
            src.stride(0), w.stride(0), w.stride(1), bias.stride(0), dst.stride(0),
            num_warps=cfg.num_warps, **cfg.constexprs,
        )
    cfg = moe_sum_launch(x.dtype)
    tiles = (triton.cdiv(tokens, int(cfg.constexprs["BLOCK_T"])),
             triton.cdiv(hidden, int(cfg.constexprs["BLOCK_H"])))
    moe_sum_kernel[tiles](y, topk_ids, out, tokens, hidden, top_k, y.stride(0), out.stride(0),
                         num_warps=cfg.num_warps, **cfg.constexprs)
    return out
