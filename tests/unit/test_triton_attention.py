"""Triton paged attention and KV writes (interpreted on CPU) against the torch reference.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` (without CUDA) before triton is first imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from kernels import TorchAttentionBackend, get_attention_backend
from kernels.attention import AttentionMetadata
from kernels.kv_quant import quantize
from kernels.triton_backend import TritonAttentionBackend, plan_block_writes, plan_tiles
from kernels.triton_codes import float_to_fp8, fp8_to_float
from tests.unit.attention_cases import make_case

HEAD_DIM = 16
# decodes, a chunk continuing a prompt across a page boundary, a whole prompt, and partial pages
MIXED = ([1, 9, 1, 21], [37, 41, 16, 21])
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
QUANTIZED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)


def _run(backend_cls: type, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         kv: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    backend = backend_cls()
    backend.prepare(meta)
    return backend.forward(q, k, v, kv, HEAD_DIM**-0.5, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("q_per_kv", "block_size"), [(1, 16), (3, 32), (8, 16)])
def test_matches_dense_attention(dtype: torch.dtype, q_per_kv: int, block_size: int) -> None:
    kv_heads = 2 if q_per_kv < 8 else 1
    case = make_case(*MIXED, num_heads=q_per_kv * kv_heads, kv_heads=kv_heads, head_dim=HEAD_DIM,
                     block_size=block_size)
    kv = case.kv.to(dtype)
    ref_kv = kv.clone()
    out = _run(TritonAttentionBackend, case.meta, case.q.to(dtype), case.new_k.to(dtype),
               case.new_v.to(dtype), kv)
    ref = _run(TorchAttentionBackend, case.meta, case.q.to(dtype), case.new_k.to(dtype),
               case.new_v.to(dtype), ref_kv)
    assert torch.equal(kv, ref_kv)  # the write put every new K/V in its slot
    torch.testing.assert_close(out.float(), case.expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_pure_decode_and_block_size_eight() -> None:
    case = make_case([1, 1, 1], [1, 8, 30], num_heads=4, kv_heads=2, head_dim=HEAD_DIM, block_size=8)
    out = _run(TritonAttentionBackend, case.meta, case.q, case.new_k, case.new_v, case.kv.clone())
    torch.testing.assert_close(out, case.expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_cache_matches_reference(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    """Same bytes and scales after the write; attention reads the stored codes like the reference."""
    case = make_case(*MIXED, num_heads=6, kv_heads=2, head_dim=HEAD_DIM, block_size=16)
    scales = torch.rand(case.kv.shape[0], 2, 2, generator=torch.Generator().manual_seed(1)) * 0.05 + 0.01
    codes = quantize(case.kv, scales[:, :, None, :, None], kv_dtype)
    args = (case.q.to(model_dtype), case.new_k.to(model_dtype), case.new_v.to(model_dtype))
    kv, kv_scales = codes.clone(), scales.clone()
    ref_kv, ref_scales = codes.clone(), scales.clone()
    out = _run(TritonAttentionBackend, case.meta, *args, kv, kv_scales)
    ref = _run(TorchAttentionBackend, case.meta, *args, ref_kv, ref_scales)
    assert torch.equal(kv.view(torch.uint8), ref_kv.view(torch.uint8))
    assert torch.equal(kv_scales, ref_scales)
    tol = TOL[model_dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_quantized_writes_over_steps_match_reference() -> None:
    """A prompt in chunks, then decodes, into partly filled blocks: scales grow, bytes stay equal."""
    kv_heads, bs, total = 2, 16, 44
    gen = torch.Generator().manual_seed(3)
    k_all, v_all = (torch.randn(total, kv_heads, HEAD_DIM, generator=gen) * 3 for _ in range(2))
    q_all = torch.randn(total, 4, HEAD_DIM, generator=gen)
    kv = torch.zeros(4, 2, bs, kv_heads, HEAD_DIM, dtype=torch.float8_e4m3fn)
    scales = torch.ones(4, 2, kv_heads)
    ref_kv, ref_scales = kv.clone(), scales.clone()
    table = [2, 0, 3]
    done = 0
    for q_len in (13, 11, 1, 1, 17, 1):
        meta = AttentionMetadata.build(bs, [q_len], [done + q_len], [table])
        rows = slice(done, done + q_len)
        out = _run(TritonAttentionBackend, meta, q_all[rows], k_all[rows], v_all[rows], kv, scales)
        ref = _run(TorchAttentionBackend, meta, q_all[rows], k_all[rows], v_all[rows], ref_kv, ref_scales)
        assert torch.equal(kv.view(torch.uint8), ref_kv.view(torch.uint8)) and torch.equal(scales, ref_scales)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        done += q_len


@triton.jit
def _roundtrip_kernel(x_ptr, codes_ptr, back_ptr, n, MANT: tl.constexpr, BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    tl.store(codes_ptr + i, float_to_fp8(tl.load(x_ptr + i, mask=ok), MANT, BIAS), mask=ok)
    tl.store(back_ptr + i, fp8_to_float(tl.load(codes_ptr + i, mask=ok), MANT, BIAS), mask=ok)


@pytest.mark.parametrize(("dtype", "mant", "bias"), [(torch.float8_e4m3fn, 3, 7), (torch.float8_e5m2, 2, 15)])
def test_fp8_bit_codecs_match_torch_casts(dtype: torch.dtype, mant: int, bias: int) -> None:
    """Every finite code decodes like torch; values (ties, subnormals, the max) encode like torch."""
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = finite[finite.isfinite()]
    mids = (finite.sort().values[1:] + finite.sort().values[:-1]) / 2  # exact ties between neighbours
    x = torch.cat([finite, mids, torch.randn(200) * 10, torch.randn(50) * 1e-3]).contiguous()
    x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    back = torch.empty_like(x)
    _roundtrip_kernel[(1,)](x, codes, back, x.numel(), MANT=mant, BIAS=bias, BLOCK=1024)
    assert torch.equal(codes, x.to(dtype).view(torch.uint8))
    assert torch.equal(back, x.to(dtype).float())


def test_tiles_cover_every_row_once() -> None:
    seqs, rows = plan_tiles([1, 5, 1, 40], q_per_kv=3, decode=False, block_m=64)
    assert list(zip(seqs, rows, strict=True)) == [(1, 0), (3, 0), (3, 64)]
    assert plan_tiles([1, 5, 1], 8, True, 16) == ([0, 2], [0, 0])


def test_block_writes_plan_runs_of_rows() -> None:
    meta = AttentionMetadata.build(16, [1, 20], [18, 22], [[5, 7], [1, 2]])
    # seq 0 writes row 1 of block 7 (token 0); seq 1 writes rows 2..15 of block 1 and 0..5 of block 2
    assert plan_block_writes(meta) == [(7, 1, 1, 0), (1, 2, 15, 1), (2, 0, 5, 15)]


def test_backend_choice_by_name() -> None:
    assert isinstance(get_attention_backend("cpu", "torch"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("cpu", "triton"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="flashinfer.*CUDA"):
        get_attention_backend("cpu", "flashinfer")
    with pytest.raises(ValueError, match="flashinfer.*quantized"):
        get_attention_backend("cuda", "flashinfer", kv_quantized=True)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="xformers")
    assert EngineConfig(dtype="auto").torch_dtype == torch.float32
    assert EngineConfig(dtype="auto", device="cuda").torch_dtype == torch.bfloat16


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_engine_greedy_tokens_match_torch_backend(tiny_model_dir: Path, kv_cache_dtype: str) -> None:
    """Chunked prompts (max 12 tokens a step) and decodes: the same greedy tokens on both backends."""
    prompts = [[5, 17, 3, 99, 42, 7, 8, 200, 31, 64, 12, 2, 90, 4, 33, 71, 18], [11, 12, 13], [250]]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    tokens = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(tiny_model_dir), attention_backend=backend, block_size=16, num_kv_blocks=16,
                  max_num_batched_tokens=12, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
        tokens[backend] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 3 for t in tokens["triton"])
