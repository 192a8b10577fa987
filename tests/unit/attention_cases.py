"""Paged-attention test cases shared by the kernel tests: a step's cache, inputs and dense answer."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.attention import AttentionBackend, AttentionMetadata


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q.shape[0]`` positions over all of ``k``/``v`` ([L, kv_heads, d]),
    in float64."""
    q_len, num_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    rep = num_heads // kv_heads
    kr = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    vr = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.matmul(q.double().transpose(0, 1), kr.transpose(1, 2)) * scale
    qpos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > qpos, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), vr).transpose(0, 1).to(q.dtype)


class Case(NamedTuple):
    meta: AttentionMetadata
    kv: torch.Tensor
    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    expected: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    tables: list[list[int]]


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> Case:
    """A step over shuffled block ids with every sequence's earlier tokens already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen)
    full_k = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s, kv_heads, head_dim, generator=gen) for s in seq_lens]
    for table, s_len, q_len, fk, fv in zip(tables, seq_lens, query_lens, full_k, full_v, strict=True):
        pos = torch.arange(s_len - q_len)
        blocks = torch.tensor(table, dtype=torch.int64)[pos // block_size]
        kv[blocks, 0, pos % block_size] = fk[: s_len - q_len]
        kv[blocks, 1, pos % block_size] = fv[: s_len - q_len]
    qs = [torch.randn(q, num_heads, head_dim, generator=gen) for q in query_lens]
    new_k = torch.cat([fk[s - q :] for fk, s, q in zip(full_k, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([fv[s - q :] for fv, s, q in zip(full_v, seq_lens, query_lens, strict=True)])
    scale = head_dim**-0.5
    expected = torch.cat(
        [dense_attention(q, fk, fv, scale) for q, fk, fv in zip(qs, full_k, full_v, strict=True)]
    )
    meta = AttentionMetadata.build(block_size, query_lens, seq_lens, tables)
    return Case(meta, kv, torch.cat(qs), new_k, new_v, expected, full_k, full_v, tables)


def attention_backend(name: str, mass: torch.Tensor | None = None) -> AttentionBackend:
    """A fresh backend by name: ``torch``, ``triton`` (interpreted on CPU) or ``native``; the native one is
    skipped where its library cannot be built. ``mass``: the blocks' attention mass to add to (torch and
    native only)."""
    import pytest

    from kernels.cpu_native import NativeCpuAttentionBackend, native_available
    from kernels.torch_ref import TorchAttentionBackend

    if name == "torch":
        return TorchAttentionBackend(mass=mass)
    if name == "triton":
        from kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if not native_available():
        pytest.skip("native CPU kernels cannot be built here")
    return NativeCpuAttentionBackend(mass=mass)


def quantized_cache(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``dtype`` (fp8/int8, or int4's uint8) cache and its per-block scales holding every sequence's
    earlier tokens of ``case`` as stored codes (the step's own tokens not written yet)."""
    from kernels.kv_quant import scale_shape, stored_head_dim, write_quantized

    blocks, _, bs, kv_heads, dim = case.kv.shape
    kv = torch.zeros(blocks, 2, bs, kv_heads, stored_head_dim(dtype, dim), dtype=dtype)
    scales = torch.ones(blocks, 2, kv_heads, *scale_shape(dtype, dim))
    for seq, table in enumerate(case.tables):
        done = case.meta.seq_lens_list[seq] - case.meta.query_lens_list[seq]
        pos = torch.arange(done)
        if done:
            write_quantized(kv, scales, case.full_k[seq][:done], case.full_v[seq][:done],
                            torch.tensor(table)[pos // bs] * bs + pos % bs, bs)
    return kv, scales
