"""Quantized KV cache (fp8 / int8 with per-block, per-head scales): sizing, writes, attention, engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.kv_sizing import kv_block_bytes, num_kv_blocks
from engine.model_runner import ModelRunner
from kernels import TorchAttentionBackend
from kernels.kv_quant import dequantize, qmax, write_quantized
from tests.unit.attention_cases import attention_backend, dense_attention, make_case, quantized_cache

QUANT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
SMOLLM2 = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e5, max_position_embeddings=8192)


def test_quantized_kv_holds_twice_the_blocks_of_bf16_per_gib() -> None:
    gib = 1024**3
    # torch's bfloat16 model (no native product) keeps a bfloat16 cache; the native bfloat16 products
    # (--dtype bfloat16 on CPU) a float32 one
    configs = [("fp32", "float32", "auto", True), ("bf16", "bfloat16", "auto", False),
               ("fp8", "float32", "fp8", True), ("fp8_e5m2", "bfloat16", "fp8_e5m2", True),
               ("int8", "float32", "int8", True), ("bf16 products", "bfloat16", "auto", True)]
    blocks = {
        name: num_kv_blocks(SMOLLM2, EngineConfig(dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=gib,
                                                  native_kernels=native))
        for name, dtype, kv, native in configs
    }
    assert blocks["bf16 products"] == blocks["fp32"]
    # one block: 16 tokens x 2 x 30 layers x 3 heads x 64 dims x 1 byte, plus 2 x 30 x 3 float32 scales
    assert kv_block_bytes(SMOLLM2, 16, torch.float8_e4m3fn) == 16 * 2 * 30 * 3 * 64 + 2 * 30 * 3 * 4
    assert blocks["fp8"] == blocks["int8"] == blocks["fp8_e5m2"] == gib // (184320 + 720)
    assert blocks["bf16"] == gib // 368640 and blocks["fp32"] == gib // 737280
    # 2x bf16 and 4x fp32, less the scale overhead (0.4% here)
    assert 1.99 * blocks["bf16"] <= blocks["fp8"] <= 2 * blocks["bf16"]
    assert 3.98 * blocks["fp32"] <= blocks["fp8"] <= 4 * blocks["fp32"]


def test_bad_kv_cache_dtype_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp4")


@pytest.mark.parametrize("dtype", QUANT, ids=str)
def test_appended_tokens_stay_covered_and_earlier_codes_stable(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bs, heads, dim = 8, 2, 16
    kv = torch.zeros(3, 2, bs, heads, dim, dtype=dtype)
    scales = torch.ones(3, 2, heads)
    ref = torch.zeros(bs, 2, heads, dim)
    # a prefill chunk of 3 tokens into block 1, then decode appends, one of them 10x larger
    pieces = [(0, 3, 1.0), (3, 4, 0.1), (4, 5, 10.0), (5, 6, 0.1), (6, 8, 1.0)]
    for start, end, magnitude in pieces:
        before = kv[1].clone()
        old_scale = scales[1].clone()
        k = torch.randn(end - start, heads, dim) * magnitude
        v = torch.randn(end - start, heads, dim) * magnitude
        write_quantized(kv, scales, k, v, torch.arange(bs + start, bs + end), bs)
        ref[start:end, 0], ref[start:end, 1] = k, v
        # the scale covers every valid token exactly: amax / qmax per (K/V, head)
        expected = ref[:end].abs().amax(dim=(0, 3)) / qmax(dtype)
        torch.testing.assert_close(scales[1], expected)
        assert torch.all(scales[1] >= old_scale) or start == 0
        got = dequantize(kv[1], scales[1][:, None, :, None]).transpose(0, 1)[:end]
        step = scales[1].transpose(0, 1)[None, :, :, None]  # one code of the int8 grid
        # int8: within one code (two roundings after growth); fp8: relative, twice the mantissa step
        relative = 0.13 if dtype == torch.float8_e4m3fn else 0.27
        tolerance = step if dtype == torch.int8 else ref[:end].abs() * relative + step * 1e-2
        assert torch.all((got - ref[:end]).abs() <= tolerance + 1e-6)
        if torch.equal(scales[1], old_scale):  # no growth: earlier tokens keep their exact codes
            assert torch.equal(kv[1][:, :start].view(torch.uint8), before[:, :start].view(torch.uint8))
    untouched = torch.stack((kv[0], kv[2])).view(torch.uint8)
    assert torch.count_nonzero(untouched) == 0


def test_reused_block_starts_a_fresh_scale() -> None:
    kv = torch.zeros(1, 2, 4, 1, 8, dtype=torch.int8)
    scales = torch.ones(1, 2, 1)
    write_quantized(kv, scales, torch.full((4, 1, 8), 100.0), torch.full((4, 1, 8), 100.0),
                    torch.arange(4), 4)
    assert float(scales[0, 0, 0]) == pytest.approx(100 / 127)
    small = torch.full((1, 1, 8), 0.5)
    write_quantized(kv, scales, small, small, torch.arange(1), 4)  # row 0 again: a new owner
    assert float(scales[0, 0, 0]) == pytest.approx(0.5 / 127)
    assert torch.count_nonzero(kv[0, :, 1:]) == 0  # stale rows of the old owner are cleared


@pytest.mark.parametrize(("dtype", "atol"), [(torch.int8, 0.03), (torch.float8_e4m3fn, 0.08),
                                             (torch.float8_e5m2, 0.25)], ids=str)
def test_attention_over_a_quantized_cache_matches_dense(dtype: torch.dtype, atol: float) -> None:
    bs, heads, kv_heads, dim = 4, 4, 2, 16
    case = make_case([1, 5, 1], [9, 12, 4], heads, kv_heads, dim, bs, seed=3)
    kv, scales = quantized_cache(case, dtype)
    backend = TorchAttentionBackend()
    backend.prepare(case.meta)
    out = backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5, scales)
    torch.testing.assert_close(out, case.expected, atol=atol, rtol=0)
    with pytest.raises(ValueError, match="scales"):
        backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5)


@pytest.mark.parametrize("backend_name", ["torch", "native"])
def test_each_query_sees_its_own_token_exactly_and_the_rest_as_stored(backend_name: str) -> None:
    """Over an fp8 cache, a query attends to the earlier tokens as stored (dequantized codes)
    and to its own K/V unquantized, in prefill chunks and decodes alike; the step's tokens are
    still written as codes."""
    bs, heads, kv_heads, dim = 4, 4, 2, 16
    case = make_case([6, 1, 3], [6, 9, 7], heads, kv_heads, dim, bs, seed=5)
    kv, scales = quantized_cache(case, torch.float8_e4m3fn)  # earlier tokens as stored codes
    backend = attention_backend(backend_name)
    backend.prepare(case.meta)
    out = backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5, scales)

    def stored(seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n)
        blocks = torch.tensor(case.tables[seq])[pos // bs]
        k, v = (dequantize(kv[blocks, i, pos % bs], scales[blocks, i][:, :, None]) for i in (0, 1))
        return k, v

    starts = [0, 6, 7]
    for seq in range(3):
        s_len, q_len = case.meta.seq_lens_list[seq], case.meta.query_lens_list[seq]
        k_st, v_st = stored(seq, s_len)
        assert not torch.equal(k_st, case.full_k[seq])  # the cache holds codes, not the exact values
        for i in range(q_len):
            p = s_len - q_len + i
            k = torch.cat((k_st[:p], case.full_k[seq][p : p + 1]))
            v = torch.cat((v_st[:p], case.full_v[seq][p : p + 1]))
            row = starts[seq] + i
            want = dense_attention(case.q[row : row + 1], k, v, dim**-0.5)
            torch.testing.assert_close(out[row : row + 1], want, atol=1e-5, rtol=1e-5)


def test_quantized_engine_allocates_codes_and_scales(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_dtype="fp8", kv_cache_memory=2 * 2**20, check_integrity=True)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_scales is not None and runner.kv_scales.shape == (2, llm.engine.kv.num_blocks, 2, 2)
    stats = llm.engine.stats()
    assert stats.kv_cache_dtype == "float8_e4m3fn"
    # 2 MiB buys blocks of 2 KiB codes (16 tokens x 2 x 2 layers x 2 heads x 16 dims) + 32 B of scales
    assert stats.num_kv_blocks == 2 * 2**20 // (2048 + 32)
    assert stats.kv_cache_bytes == stats.num_kv_blocks * (2048 + 32)
    prompt = list(range(1, 40))
    out = llm.generate([prompt, prompt[:20]], SamplingParams(max_tokens=8, temperature=0.0))
    assert [len(o.token_ids) for o in out] == [8, 8]
    # a prefix-cache hit reads the same quantized blocks: same tokens again
    again = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == out[0].token_ids


def test_fp8_greedy_agrees_with_full_precision_on_the_default_model(default_model_path: Path) -> None:
    """The cheap version of ``bench/lab/kv_quant.py``: 4 prompts x 8 tokens, one model load.

    Looser than the bench: every first token agrees, and at least 2 of 4 outputs are identical.
    """
    llm = LLM(str(default_model_path), kv_cache_dtype="fp8", num_kv_blocks=48)
    engine = llm.engine
    fp8_runner = engine.runner
    full = ModelRunner(fp8_runner.model, engine.model_config, replace(engine.config, kv_cache_dtype="auto"),
                       engine.kv.num_blocks)
    prompts = [[{"role": "user", "content": c}] for c in
               ("What is the capital of France?", "Name three primary colors.",
                "What is 12 times 7?", "Why is the sky blue?")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    quantized = [o.token_ids for o in llm.chat(prompts, params)]
    engine.kv.pool.reset_prefix_cache()
    engine.runner = full
    reference = [o.token_ids for o in llm.chat(prompts, params)]
    assert [a[0] for a in quantized] == [b[0] for b in reference]
    assert sum(a == b for a, b in zip(quantized, reference, strict=True)) >= 2


def test_kv_dtype_and_scales_are_part_of_transfer_compatibility() -> None:
    from transfer.compat import check_compatible, compat_hash
    from transfer.errors import IncompatibleKvError
    from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

    kv = torch.zeros(2, 4, 2, 16, 3, 64, dtype=torch.float8_e4m3fn)
    scales = torch.ones(2, 4, 2, 3)
    fp8 = KvLayout.from_tensor(kv, "m", scales)
    assert fp8.dtype == "float8_e4m3fn" and fp8.scale_region_bytes == 2 * 3 * 4
    assert fp8.total_bytes == 2 * 4 * (2 * 16 * 3 * 64 + 24)
    others = [KvLayout.from_tensor(kv.view(torch.float8_e5m2), "m", scales),
              KvLayout.from_tensor(kv.view(torch.int8), "m", scales),
              msgspec.structs.replace(fp8, scale_region_bytes=0)]
    for other in others:
        assert compat_hash(other) != compat_hash(fp8)
        info = AgentInfo(WIRE_VERSION, compat_hash(other), "peer", b"", 0, 0, "DRAM", other)
        with pytest.raises(IncompatibleKvError):
            check_compatible(fp8, info)
    with pytest.raises(ValueError, match="scales"):
        KvLayout.from_tensor(kv, "m", torch.ones(2, 4, 2, 2))
