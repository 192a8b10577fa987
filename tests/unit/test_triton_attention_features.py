"""Sliding windows, attention sinks and logit softcapping in the Triton attention kernel (interpreted on
CPU), against a dense attention computed here: a plain float64 softmax over each query's gathered keys.

Tolerances as ``test_triton_attention.py``'s: float32 2e-5 (the kernel's float32 online softmax against
float64), bfloat16 3e-2 (inputs rounded to bfloat16, ``p`` rounded to bfloat16 before ``p @ v``).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs
from kernels.attention import AttentionMetadata
from kernels.kv_quant import codes_to_float, quantize
from kernels.triton_backend import TritonAttentionBackend
from tests.unit.attention_cases import Case, make_case

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
# decodes, a chunk continuing a prompt across a page boundary, a whole prompt, and partial pages
MIXED = ([1, 9, 1, 21], [37, 41, 16, 21])
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
NO_WINDOW = 10**9


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
          softcap: float | None, scale: float = SCALE) -> torch.Tensor:
    """Each query of the last ``q.shape[0]`` positions over its own keys ``[max(0, p - W + 1), p]``, in
    float64: scores ``q.k * scale``, capped, a sink logit per head in the denominator."""
    q_len, num_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    rep = num_heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q_len):
        p = seq_len - q_len + i
        lo = max(0, p - (window or NO_WINDOW) + 1)
        keys = k[lo:p + 1].double().repeat_interleave(rep, dim=1)  # [n, heads, d]
        vals = v[lo:p + 1].double().repeat_interleave(rep, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        prob = torch.softmax(s, dim=1)[:, : p + 1 - lo]
        out[i] = torch.einsum("hn,nhd->hd", prob, vals)
    return out


def expected(case: Case, window: int | None, sinks: torch.Tensor | None, softcap: float | None,
             dtype: torch.dtype) -> torch.Tensor:
    rows = []
    start = 0
    for q_len, fk, fv in zip(case.meta.query_lens_list, case.full_k, case.full_v, strict=True):
        q = case.q[start:start + q_len].to(dtype)
        rows.append(dense(q, fk.to(dtype), fv.to(dtype), window, sinks, softcap))
        start += q_len
    return torch.cat(rows)


def poison_before_windows(case: Case, kv: torch.Tensor, window: int) -> int:
    """NaN into every cache position before the earliest window of each sequence's new queries (what a
    sliding-window cache may have released and reused): a kernel that reads one is not finite.
    Returns how many whole blocks were poisoned."""
    bs = case.meta.block_size
    whole = 0
    meta = case.meta
    for q_len, s_len, table in zip(meta.query_lens_list, meta.seq_lens_list, case.tables, strict=True):
        first = s_len - q_len - window + 1  # the first query's window starts here
        for pos in range(max(first, 0)):
            kv[table[pos // bs], :, pos % bs] = float("nan")
        whole += max(first, 0) // bs
    return whole


def run(case: Case, kv: torch.Tensor, dtype: torch.dtype, kv_scales: torch.Tensor | None = None,
        **features: object) -> torch.Tensor:
    backend = TritonAttentionBackend()
    backend.prepare(case.meta)
    return backend.forward(case.q.to(dtype), case.new_k.to(dtype), case.new_v.to(dtype), kv, SCALE, kv_scales,
                           **features)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [3, 16, 21, 100])
def test_window_matches_dense(dtype: torch.dtype, window: int) -> None:
    """Windows smaller than a block (3), one block (16), across block edges (21), longer than every
    sequence (100); GQA 3 query heads per KV head; what lies before every window is NaN."""
    case = make_case(*MIXED, num_heads=6, kv_heads=2, head_dim=HEAD_DIM, block_size=16)
    kv = case.kv.to(dtype)
    poisoned = poison_before_windows(case, kv, window)
    assert poisoned >= (1 if window <= 16 else 0)  # whole blocks skipped, not only masked
    out = run(case, kv, dtype, window=window)
    torch.testing.assert_close(out.double(), expected(case, window, None, None, dtype),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 21])
def test_sinks_match_dense(dtype: torch.dtype, window: int | None) -> None:
    case = make_case(*MIXED, num_heads=8, kv_heads=2, head_dim=HEAD_DIM, block_size=16, seed=1)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2
    sinks[3] = 6.0  # a sink above every score: the running maximum starts from it
    out = run(case, case.kv.to(dtype), dtype, window=window, sinks=sinks)
    ref = expected(case, window, sinks, None, dtype)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    no_sink = expected(case, window, None, None, dtype)
    assert (ref - no_sink).abs().max() > 0.1  # the sinks matter at this tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_with_window_and_sinks_matches_dense(dtype: torch.dtype) -> None:
    case = make_case(*MIXED, num_heads=4, kv_heads=4, head_dim=HEAD_DIM, block_size=8, seed=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6))
    q = case.q * 4  # scores of several units, well into tanh's bend at cap 2
    case = case._replace(q=q)
    out = run(case, case.kv.to(dtype), dtype, window=13, sinks=sinks, softcap=2.0)
    ref = expected(case, 13, sinks, 2.0, dtype)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert (ref - expected(case, 13, sinks, None, dtype)).abs().max() > 0.1


def test_features_over_a_quantized_cache() -> None:
    """fp8 cache: earlier keys as stored (codes x scales), each query's own K/V exact, as the reference
    backends read it; window, sinks and softcap all on."""
    case = make_case(*MIXED, num_heads=6, kv_heads=2, head_dim=HEAD_DIM, block_size=16, seed=3)
    scales = torch.rand(case.kv.shape[0], 2, 2, generator=torch.Generator().manual_seed(1)) * 0.05 + 0.01
    kv = quantize(case.kv, scales[:, :, None, :, None], torch.float8_e4m3fn)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(7))
    window, softcap = 19, 3.0
    out = run(case, kv, torch.float32, scales, window=window, sinks=sinks, softcap=softcap)
    stored = codes_to_float(kv) * scales[:, :, None, :, None]  # after the write
    start = 0
    for s, (q_len, s_len, table) in enumerate(zip(case.meta.query_lens_list, case.meta.seq_lens_list,
                                                   case.tables, strict=True)):
        pos = torch.arange(s_len)
        blocks = torch.tensor(table)[pos // 16]
        k_all, v_all = stored[blocks, 0, pos % 16], stored[blocks, 1, pos % 16]
        for i in range(q_len):  # query i's own key and value exact, the rest as stored
            p = s_len - q_len + i
            k = torch.cat([k_all[:p], case.full_k[s][p:p + 1]])
            v = torch.cat([v_all[:p], case.full_v[s][p:p + 1]])
            want = dense(case.q[start + i:start + i + 1], k, v, window, sinks, softcap)
            torch.testing.assert_close(out[start + i:start + i + 1].double(), want, atol=2e-5, rtol=2e-5)
        start += q_len


def test_decode_window_reads_only_its_keys() -> None:
    """A decode at position 200 with window 5: every other key is NaN, the answer is the 5 keys'."""
    meta = AttentionMetadata.build(16, [1], [201], [list(range(13))])
    gen = torch.Generator().manual_seed(4)
    kv = torch.full((13, 2, 16, 1, HEAD_DIM), float("nan"))
    k, v = torch.randn(5, 1, HEAD_DIM, generator=gen), torch.randn(5, 1, HEAD_DIM, generator=gen)
    pos = torch.arange(196, 200)
    kv[pos // 16, 0, pos % 16], kv[pos // 16, 1, pos % 16] = k[:4], v[:4]
    q = torch.randn(1, 2, HEAD_DIM, generator=gen)
    backend = TritonAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, k[4:], v[4:], kv, SCALE, window=5)
    full_k = torch.cat([torch.zeros(196, 1, HEAD_DIM), k])
    full_v = torch.cat([torch.zeros(196, 1, HEAD_DIM), v])
    torch.testing.assert_close(out.double(), dense(q, full_k, full_v, 5, None, None), atol=2e-5, rtol=2e-5)


def test_capture_path_with_features_equals_planned_steps() -> None:
    """A bucket planned once on pad rows (``prepare_capture``, as before a CUDA-graph capture), then
    steps copied into the same static buffers (``prepare_replay``): with a window, sinks and a softcap
    fixed for the layer, its real rows equal a backend planned for each step, bit for bit."""
    bs, blocks = 16, 12
    graphs = DecodeGraphs(4, 4, bs, scratch_block=blocks - 1, device="cpu")
    gen = torch.Generator().manual_seed(8)
    kv = torch.randn(blocks, 2, bs, 2, HEAD_DIM, generator=gen)
    sinks = torch.randn(6, generator=gen)

    def attend(backend: TritonAttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache: torch.Tensor) -> torch.Tensor:
        return backend.forward(q, k, v, cache, SCALE, window=7, sinks=sinks, softcap=2.5)

    captured = TritonAttentionBackend().capture_instance()
    captured.prepare_capture(graphs.pad_only(4).meta)
    attend(captured, torch.zeros(4, 6, HEAD_DIM), torch.zeros(4, 2, HEAD_DIM), torch.zeros(4, 2, HEAD_DIM),
           kv)  # the warm-up: pad rows only, into the scratch block
    tables = [[0, 1, 2], [3], [4, 5, 6, 7]]
    for lens in ([40, 9, 50], [41, 10, 51], [48, 16, 64]):
        q, k, v = (torch.randn(3, n, HEAD_DIM, generator=gen) for n in (6, 2, 2))
        padded = graphs.pad([0, 0, 0], [s - 1 for s in lens], lens, tables)
        assert padded is not None and padded.bucket == 4
        captured.prepare_replay(padded.meta)
        kv_captured = kv.clone()
        got = attend(captured, torch.cat([q, q[:1]]), torch.cat([k, k[:1]]), torch.cat([v, v[:1]]),
                     kv_captured)[:3]
        eager = TritonAttentionBackend()
        eager.prepare(AttentionMetadata.build(bs, [1, 1, 1], lens, tables))
        kv_eager = kv.clone()
        assert torch.equal(got, attend(eager, q, k, v, kv_eager))
        assert torch.equal(kv_captured[:blocks - 1], kv_eager[:blocks - 1])  # pad rows wrote only scratch


def test_feature_arguments_are_checked() -> None:
    case = make_case([1], [5], num_heads=2, kv_heads=1, head_dim=HEAD_DIM, block_size=16)
    backend = TritonAttentionBackend()
    backend.prepare(case.meta)
    args = (case.q, case.new_k, case.new_v, case.kv.clone(), SCALE)
    with pytest.raises(ValueError, match="window must be a positive int"):
        backend.forward(*args, window=0)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        backend.forward(*args, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must be float32 \[2\]"):
        backend.forward(*args, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must be float32 \[2\]"):
        backend.forward(*args, sinks=torch.zeros(2, dtype=torch.float64))
    assert TritonAttentionBackend.features == {"window", "sinks", "softcap"}
    assert math.isfinite(float(backend.forward(*args, window=1, softcap=1.0).abs().max()))
