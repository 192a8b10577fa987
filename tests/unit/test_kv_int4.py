"""int4 KV cache (``kernels/kv_int4.py``): layout, writes, both attention backends against the stored bytes,
sizing, the engine, transfer compatibility."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv_sizing import kv_block_bytes, num_kv_blocks
from kernels import TorchAttentionBackend, kv_int4
from kernels.attention import AttentionMetadata
from kernels.kv_quant import write_quantized
from tests.unit.attention_cases import attention_backend, dense_attention, make_case
from tests.unit.test_kv_quant import SMOLLM2


def stored_values(kv: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Float64 values ``[blocks, parts, bs, H, D]`` read straight from the bytes: channel ``d`` is nibble
    ``d % 2`` of byte ``d // 2``, ``low + code * step`` of its group (written out here, not through
    ``kv_int4``)."""
    blocks, parts, bs, heads, half = kv.shape
    dim = 2 * half
    size = dim // params.shape[-2]
    out = torch.empty(blocks, parts, bs, heads, dim, dtype=torch.float64)
    for d in range(dim):
        code = (kv[..., d // 2].to(torch.int64) >> (4 * (d % 2))) & 15
        low = params[:, :, None, :, d // size, 0].double()
        step = params[:, :, None, :, d // size, 1].double()
        out[..., d] = low + code.double() * step
    return out


def fill(case_kv_shape: tuple[int, ...], case: object, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 cache holding every sequence's earlier tokens of ``case`` (written per sequence)."""
    num_blocks, _, _, kv_heads, dim = case_kv_shape
    kv = torch.zeros(num_blocks, 2, bs, kv_heads, dim // 2, dtype=torch.uint8)
    params = torch.zeros(num_blocks, 2, kv_heads, kv_int4.num_groups(dim), 2)
    for table, s_len, q_len, fk, fv in zip(case.tables, case.meta.seq_lens_list,  # type: ignore[attr-defined]
                                           case.meta.query_lens_list, case.full_k, case.full_v,  # type: ignore[attr-defined]
                                           strict=True):
        pos = torch.arange(s_len - q_len)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        write_quantized(kv, params, fk[: s_len - q_len], fv[: s_len - q_len], slots, bs)
    return kv, params


def test_two_codes_a_byte_even_channel_low() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = kv_int4.pack(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(kv_int4.unpack(packed), codes)
    params = torch.tensor([[[-1.0, 0.5], [2.0, 0.25], [0.0, 1.0]]])  # three groups of two channels
    assert kv_int4.dequantize(packed, params).tolist() == [[-0.5, 0.0, 5.75, 2.0, 7.0, 9.0]]


def test_appended_tokens_stay_covered_and_stale_rows_cleared() -> None:
    torch.manual_seed(0)
    bs, heads, dim = 8, 2, 64
    kv = torch.zeros(3, 2, bs, heads, dim // 2, dtype=torch.uint8)
    groups, size = kv_int4.num_groups(dim), kv_int4.group_size(dim)
    params = torch.zeros(3, 2, heads, groups, 2)
    ref = torch.zeros(bs, 2, heads, dim)
    for start, end, magnitude in [(0, 3, 1.0), (3, 4, 0.1), (4, 5, 10.0), (5, 6, 0.1), (6, 7, 1.0)]:
        before, old = kv[1].clone(), params[1].clone()
        k, v = (torch.randn(end - start, heads, dim) * magnitude for _ in range(2))
        write_quantized(kv, params, k, v, torch.arange(bs + start, bs + end), bs)
        ref[start:end, 0], ref[start:end, 1] = k, v
        got = stored_values(kv, params)[1].transpose(0, 1)[:end].float()  # [end, parts, H, D]
        low, step = params[1][..., 0], params[1][..., 1]  # [parts, H, G]
        step_d = step.repeat_interleave(size, dim=-1)[None]
        # within one code of the grid (a rounding now and, after the range grew, one before)
        assert torch.all((got - ref[:end]).abs() <= step_d * 1.0001)
        # the new rows are exact inputs of the range: low is at most their minimum
        new = ref[start:end].view(end - start, 2, heads, groups, size)
        assert torch.all(low <= new.amin(dim=(0, 4)) + 1e-6)
        if start == 0:  # a fresh block: the range is exactly the rows'
            torch.testing.assert_close(low, new.amin(dim=(0, 4)), rtol=0, atol=0)
            torch.testing.assert_close(step, (new.amax(dim=(0, 4)) - low) / 15, rtol=0, atol=0)
        elif torch.equal(params[1], old):  # no growth: earlier tokens keep their exact bytes
            assert torch.equal(kv[1][:, :start], before[:, :start])
        assert torch.count_nonzero(kv[1][:, end:]) == 0  # rows past the last written: code 0
    assert torch.count_nonzero(torch.stack((kv[0], kv[2]))) == 0


def test_reused_block_starts_a_fresh_range() -> None:
    kv = torch.zeros(1, 2, 4, 1, 32, dtype=torch.uint8)
    params = torch.zeros(1, 2, 1, kv_int4.num_groups(64), 2)
    big = torch.linspace(-100, 100, 4 * 64).view(4, 1, 64)
    write_quantized(kv, params, big, big, torch.arange(4), 4)
    small = torch.linspace(0, 1.5, 64).view(1, 1, 64)
    write_quantized(kv, params, small, small, torch.arange(1), 4)  # row 0 again: a new owner
    size = kv_int4.group_size(64)
    assert params[0, 0, 0, 0].tolist() == [0.0, pytest.approx(float(small[0, 0, size - 1]) / 15, rel=1e-6)]
    assert torch.count_nonzero(kv[0, :, 1:]) == 0
    torch.testing.assert_close(stored_values(kv, params)[0, 0, 0, 0].float(), small[0, 0], atol=0.05, rtol=0)


@pytest.mark.parametrize("backend_name", ["torch", "triton", "native"])
def test_attention_reads_the_stored_bytes(backend_name: str) -> None:
    """Each query sees the earlier tokens as the bytes say and its own K/V exactly, in prefill chunks
    and decodes, on the torch reference, the Triton kernels (interpreted on CPU) and the native CPU kernels
    (row items and, for the 21-token chunk, blocked ones)."""
    bs, heads, kv_heads, dim = 16, 6, 2, 64
    case = make_case([1, 9, 1, 21], [37, 41, 16, 21], heads, kv_heads, dim, bs, seed=5)
    kv, params = fill(tuple(case.kv.shape), case, bs)
    backend = attention_backend(backend_name)
    backend.prepare(case.meta)
    out = backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5, params)
    values = stored_values(kv, params)
    start = 0
    for seq, table in enumerate(case.tables):
        s_len, q_len = case.meta.seq_lens_list[seq], case.meta.query_lens_list[seq]
        pos = torch.arange(s_len)
        blocks = torch.tensor(table)[pos // bs]
        k_st, v_st = (values[blocks, i, pos % bs].float() for i in (0, 1))
        for i in range(q_len):
            p = s_len - q_len + i
            k = torch.cat((k_st[:p], case.full_k[seq][p : p + 1]))
            v = torch.cat((v_st[:p], case.full_v[seq][p : p + 1]))
            want = dense_attention(case.q[start + i : start + i + 1], k, v, dim**-0.5)
            torch.testing.assert_close(out[start + i : start + i + 1], want, atol=2e-5, rtol=2e-5)
        start += q_len


def test_triton_writes_the_reference_bytes_over_steps() -> None:
    """A prompt in chunks, then decodes, into partly filled blocks: ranges grow, bytes stay equal."""
    from kernels.triton_backend import TritonAttentionBackend

    kv_heads, bs, total, dim = 2, 16, 44, 64
    gen = torch.Generator().manual_seed(3)
    k_all, v_all = (torch.randn(total, kv_heads, dim, generator=gen) * 3 for _ in range(2))
    k_all[30] *= 8  # a token that widens its block's range
    q_all = torch.randn(total, 4, dim, generator=gen)
    kv = torch.zeros(4, 2, bs, kv_heads, dim // 2, dtype=torch.uint8)
    params = torch.zeros(4, 2, kv_heads, kv_int4.num_groups(dim), 2)
    ref_kv, ref_params = kv.clone(), params.clone()
    table, done = [2, 0, 3], 0
    for q_len in (13, 11, 1, 1, 5, 1, 11, 1):
        meta = AttentionMetadata.build(bs, [q_len], [done + q_len], [table])
        rows = slice(done, done + q_len)
        outs = []
        for backend, cache, prm in ((TritonAttentionBackend(), kv, params),
                                    (TorchAttentionBackend(), ref_kv, ref_params)):
            backend.prepare(meta)
            outs.append(backend.forward(q_all[rows], k_all[rows], v_all[rows], cache, dim**-0.5, prm))
        assert torch.equal(kv, ref_kv) and torch.equal(params, ref_params)
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
        done += q_len


def test_int4_holds_twice_the_blocks_of_int8_less_the_ranges() -> None:
    gib = 1024**3
    # codes: 16 tokens x 2 x 30 layers x 3 heads x 32 bytes; ranges: 2 x 30 x 3 heads x 4 groups x 2 float32
    assert kv_block_bytes(SMOLLM2, 16, torch.uint8) == 92160 + 5760
    int4 = num_kv_blocks(SMOLLM2, EngineConfig(kv_cache_dtype="int4", kv_cache_memory=gib))
    int8 = num_kv_blocks(SMOLLM2, EngineConfig(kv_cache_dtype="int8", kv_cache_memory=gib))
    assert int4 == gib // 97920 and int8 == gib // 185040
    # 2x int8's codes; the ranges take 5.9% of a block where int8's one scale takes 0.4%
    assert 1.88 * int8 <= int4 <= 2 * int8


def test_int4_engine_allocates_bytes_and_ranges(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_dtype="int4", kv_cache_memory=2 * 2**20, check_integrity=True)
    runner = llm.engine.runner
    blocks = llm.engine.kv.num_blocks
    assert runner.kv_cache.dtype == torch.uint8 and runner.kv_cache.shape == (2, blocks, 2, 16, 2, 8)
    assert runner.kv_scales is not None and runner.kv_scales.shape == (2, blocks, 2, 2, 1, 2)
    stats = llm.engine.stats()
    assert stats.kv_cache_dtype == "int4"
    # 16 tokens x 2 x 2 layers x 2 heads x 8 bytes + 2 x 2 layers x 2 heads x 1 group x 2 float32
    assert stats.num_kv_blocks == 2 * 2**20 // (1024 + 64)
    prompt = list(range(1, 40))
    out = llm.generate([prompt, prompt[:20]], SamplingParams(max_tokens=8, temperature=0.0))
    assert [len(o.token_ids) for o in out] == [8, 8]
    again = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert again.metrics.cached_prompt_tokens == 32 and again.token_ids == out[0].token_ids


def test_int4_layout_is_its_own_transfer_format() -> None:
    from transfer.compat import check_compatible, compat_hash
    from transfer.errors import IncompatibleKvError
    from transfer.nixl_source import check_tensor
    from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout

    kv = torch.zeros(2, 4, 2, 16, 3, 32, dtype=torch.uint8)
    params = torch.zeros(2, 4, 2, 3, 2, 2)
    int4 = KvLayout.from_tensor(kv, "m", params)
    assert int4.dtype == "int4" and int4.scale_tail == (2, 2) and int4.scale_region_bytes == 2 * 3 * 2 * 2 * 4
    assert int4.scales_shape == tuple(params.shape)
    check_tensor(kv, int4, params)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(int4), type=KvLayout) == int4
    int8_kv = torch.zeros(2, 4, 2, 16, 3, 64, dtype=torch.int8)
    int8 = KvLayout.from_tensor(int8_kv, "m", torch.ones(2, 4, 2, 3))
    assert compat_hash(int8) != compat_hash(int4)
    with pytest.raises(IncompatibleKvError):
        check_compatible(int4, AgentInfo(WIRE_VERSION, compat_hash(int8), "peer", b"", 0, 0, "DRAM", int8))
    with pytest.raises(ValueError, match="scales"):
        check_tensor(kv, int4, torch.zeros(2, 4, 2, 3, 1, 2))


def test_int4_needs_head_dim_in_groups_and_refuses_latent_caches() -> None:
    with pytest.raises(ValueError, match="int4 needs a head dimension"):
        kv_int4.num_groups(40)
    from dataclasses import replace

    from engine.config import MlaConfig
    from engine.kv_tensors import allocate_kv_cache

    latent = replace(SMOLLM2, mla=MlaConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                            v_head_dim=128))
    with pytest.raises(ValueError, match="--kv-cache-dtype int4 does not store latent attention"):
        allocate_kv_cache(latent, 4, 16, torch.uint8, "cpu")
