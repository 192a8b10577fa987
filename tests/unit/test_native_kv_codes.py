"""The native CPU kernels over a quantized KV cache (``kernels/cpu_kv_codes.c``): the write's bytes equal the
torch reference's, every code reads back as the reference dequantizes it, and attention, the one-call
decoder and an engine agree with the torch reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import kv_int4
from kernels.attention import AttentionMetadata
from kernels.cpu_native import NativeCpuAttentionBackend, native_available
from kernels.kv_quant import KV_CACHE_DTYPES, code_values, scale_shape, stored_head_dim
from kernels.torch_ref import TorchAttentionBackend
from tests.families import agree_up_to_a_near_tie

pytestmark = pytest.mark.skipif(not native_available(), reason="native CPU kernels cannot be built here")

FORMATS = ["int8", "fp8", "fp8_e5m2", "int4"]


def empty_cache(name: str, blocks: int, bs: int, kv_heads: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = KV_CACHE_DTYPES[name]
    assert dtype is not None
    return (torch.zeros(blocks, 2, bs, kv_heads, stored_head_dim(dtype, dim), dtype=dtype),
            torch.zeros(blocks, 2, kv_heads, *scale_shape(dtype, dim)))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("name", FORMATS)
def test_writes_the_reference_bytes_over_steps(name: str) -> None:
    """Prompt chunks, then decodes, into partly filled blocks whose ranges grow (a token 8x larger) and
    shrink to tiny values: after every step codes and scales equal the torch write's, and attention agrees."""
    kv_heads, bs, dim = 2, 16, 64
    gen = torch.Generator().manual_seed(3)
    total = 76
    k_all, v_all = (torch.randn(total, kv_heads, dim, generator=gen) * 3 for _ in range(2))
    k_all[30] *= 8
    k_all[48:64] *= 1e-6  # a block of small values: fp8 subnormal codes after scaling
    v_all[50] *= 1e-30
    q_all = torch.randn(total, 4, dim, generator=gen)
    kv, scales = empty_cache(name, 6, bs, kv_heads, dim)
    ref_kv, ref_scales = kv.clone(), scales.clone()
    table, done = [2, 0, 3, 5, 4], 0
    for q_len in (13, 11, 1, 1, 5, 1, 16, 11, 1, 16):
        meta = AttentionMetadata.build(bs, [q_len], [done + q_len], [table])
        rows = slice(done, done + q_len)
        native, ref = NativeCpuAttentionBackend(), TorchAttentionBackend()
        native.prepare(meta)
        ref.prepare(meta)
        got = native.forward(q_all[rows], k_all[rows], v_all[rows], kv, dim**-0.5, scales)
        want = ref.forward(q_all[rows], k_all[rows], v_all[rows], ref_kv, dim**-0.5, ref_scales)
        assert native._fallback_meta is None  # the native kernels ran
        assert same_bytes(kv, ref_kv) and torch.equal(scales, ref_scales), f"after {done + q_len} tokens"
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        done += q_len


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_codes_round_as_torch_converts(name: str) -> None:
    """A block whose largest value is the format's largest (its scale exactly 1) holds values across the
    whole range, subnormals and ties included: its codes are torch's conversion of them."""
    dtype = KV_CACHE_DTYPES[name]
    assert dtype is not None
    top = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (16 * 64,), generator=gen).to(torch.uint8).view(dtype).float()
    codes = codes.nan_to_num(0.0, 0.0, 0.0).clamp(-top, top)
    halfway = (codes[:-1] + codes[1:]) / 2  # ties and near-ties between neighbours
    powers = torch.randint(-20, 16, (16 * 64,), generator=gen).float()
    jitter = torch.randn(16 * 64, generator=gen) * 2.0**powers
    for values in (codes, torch.cat((halfway, codes[:1])), jitter.clamp(-top, top)):
        values[0] = top
        rows = values.view(16, 1, 64)
        kv, scales = empty_cache(name, 1, 16, 1, 64)
        native = NativeCpuAttentionBackend()
        native.prepare(AttentionMetadata.build(16, [16], [16], [[0]]))
        native.forward(torch.zeros(16, 1, 64), rows, rows, kv, 0.125, scales)
        assert torch.equal(scales, torch.ones_like(scales))
        assert same_bytes(kv[0, 0, :, 0], values.view(16, 64).to(dtype))


@pytest.mark.parametrize("name", FORMATS)
def test_every_code_reads_back_as_the_reference_dequantizes_it(name: str) -> None:
    """Each sequence caches one token whose V row holds codes set by hand (in a block of one token, so the
    step's write of its own token leaves it alone), and attends with a zero query and a zero own V: the
    output is exactly half the dequantized row (two keys, equal weights), so every code's value (NaN and
    infinities included) is checked bit for bit."""
    dtype = KV_CACHE_DTYPES[name]
    assert dtype is not None
    dim = 64
    int4 = kv_int4.is_int4(dtype)
    values = torch.arange(16 if int4 else 256, dtype=torch.int64).repeat(4 if int4 else 1).view(-1, dim)
    seqs = values.shape[0]
    kv, scales = empty_cache(name, 2 * seqs, 1, 1, dim)
    cached = torch.arange(0, 2 * seqs, 2)  # block 2s holds sequence s's cached token, 2s + 1 its new one
    if int4:
        kv[cached, 1, 0, 0] = kv_int4.pack(values.to(torch.uint8))
        scales[..., 0], scales[..., 1] = -1.25, 0.375  # low, step of every group
        expected = kv_int4.dequantize(kv[cached, 1, 0, 0], scales[cached, 1, 0])
    else:
        kv.view(torch.uint8)[cached, 1, 0, 0] = values.to(torch.uint8)
        scales[:] = 0.75
        expected = code_values(dtype)[values] * 0.75
    meta = AttentionMetadata.build(1, [1] * seqs, [2] * seqs, [[2 * s, 2 * s + 1] for s in range(seqs)])
    native = NativeCpuAttentionBackend()
    native.prepare(meta)
    zeros = torch.zeros(seqs, 1, dim)
    out = native.forward(zeros, zeros, zeros, kv, 0.125, scales)
    assert native._fallback_meta is None
    torch.testing.assert_close(out[:, 0], expected * 0.5, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_an_engine_on_native_kernels_matches_the_torch_reference(tiny_model_dir: Path, name: str) -> None:
    """The tiny model served over a quantized cache by the native kernels (the one-call decoder included)
    and by the torch reference: greedy tokens agree up to a near tie, and the native backend never handed a
    layer to the torch one."""
    prompts = [list(range(3, 40)), list(range(50, 61)), [7] * 70]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    runs = []
    for backend in ("auto", "torch"):
        llm = LLM(str(tiny_model_dir), kv_cache_dtype=name, attention_backend=backend, num_kv_blocks=64)
        attention = llm.engine.runner.backend
        assert isinstance(attention, NativeCpuAttentionBackend) == (backend == "auto")
        runs.append(llm.generate(prompts, params))
        if isinstance(attention, NativeCpuAttentionBackend):
            assert attention._fallback_meta is None
    for native, ref in zip(*runs, strict=True):
        tops = [t.top for t in ref.logprobs or [] if t is not None]
        agree_up_to_a_near_tie(native.token_ids, ref.token_ids, tops, 1e-3)
