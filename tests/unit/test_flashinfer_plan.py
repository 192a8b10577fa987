"""flashinfer's page-table arrays planned from our metadata: invariants, and attention read through them.

No flashinfer here: a torch attention reads K/V only through ``kv_indptr``/``kv_indices``/
``kv_last_page_len`` and queries through ``qo_indptr``, as flashinfer would.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.flashinfer_plan import FlashInferPlan, LayerVariant, flashinfer_variant, plan_flashinfer
from tests.unit.attention_cases import dense_attention, make_case
from tests.unit.test_triton_attention_features import dense


def _check_invariants(plan: FlashInferPlan, meta: AttentionMetadata) -> None:
    n = meta.num_seqs
    assert sorted(plan.order) == list(range(n))
    assert len(plan.qo_indptr) == len(plan.kv_indptr) == n + 1 and len(plan.kv_last_page_len) == n
    assert plan.qo_indptr[0] == plan.kv_indptr[0] == 0
    assert plan.qo_indptr[-1] == meta.num_tokens and plan.kv_indptr[-1] == len(plan.kv_indices)
    q_lens = [b - a for a, b in zip(plan.qo_indptr, plan.qo_indptr[1:], strict=False)]
    assert q_lens == [meta.query_lens_list[s] for s in plan.order]
    ones = [q == 1 for q in q_lens]
    assert ones == sorted(ones, reverse=True)  # decodes first
    for i, s in enumerate(plan.order):
        pages = plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]]
        last = plan.kv_last_page_len[i]
        assert 1 <= last <= plan.page_size
        assert (len(pages) - 1) * plan.page_size + last == meta.seq_lens_list[s]
        assert pages == meta.block_tables_list[s][: len(pages)]
    if plan.token_order is not None:
        assert sorted(plan.token_order) == list(range(meta.num_tokens))


def _attend_through_plan(plan: FlashInferPlan, q: torch.Tensor, kv: torch.Tensor, scale: float,
                         variant: LayerVariant | None = None) -> torch.Tensor:
    """Our row order in, our row order out; K/V located only through the plan's arrays. ``variant``'s
    parameters as flashinfer documents them: the query at ``p`` attends ``[p - window_left, p]`` (all
    of ``[0, p]`` when -1) and, with ``logits_soft_cap`` c > 0, ``x = q.k * sm_scale`` becomes
    ``c * tanh(x / c)``."""
    order = plan.token_order or list(range(q.shape[0]))
    planned_q = q[order]
    out = torch.empty_like(planned_q)
    for i in range(len(plan.order)):
        pages = plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]]
        length = (len(pages) - 1) * plan.page_size + plan.kv_last_page_len[i]
        k = kv[pages, 0].flatten(0, 1)[:length]
        v = kv[pages, 1].flatten(0, 1)[:length]
        rows = slice(plan.qo_indptr[i], plan.qo_indptr[i + 1])
        if variant is None:
            out[rows] = dense_attention(planned_q[rows], k, v, scale)
            continue
        for r in range(rows.start, rows.stop):
            p = length - (rows.stop - rows.start) + (r - rows.start)
            lo = 0 if variant.window_left < 0 else max(0, p - variant.window_left)
            heads = q.shape[1] // k.shape[1]
            keys = k[lo:p + 1].repeat_interleave(heads, dim=1).double()
            x = torch.einsum("hd,nhd->hn", planned_q[r].double(), keys) * scale
            if variant.logits_soft_cap > 0:
                x = variant.logits_soft_cap * torch.tanh(x / variant.logits_soft_cap)
            vals = v[lo:p + 1].repeat_interleave(heads, dim=1).double()
            out[r] = torch.einsum("hn,nhd->hd", torch.softmax(x, dim=1), vals).to(out.dtype)
    result = torch.empty_like(out)
    result[order] = out
    return result


@pytest.mark.parametrize(("query_lens", "seq_lens", "block_size"), [
    ([7, 1, 13, 1, 1], [7, 40, 29, 16, 17], 16),  # prefills between decodes, partial and exact pages
    ([1, 1, 1], [1, 32, 33], 32),  # pure decode, already in order
    ([5, 9], [5, 70], 8),  # prefill chunks only
])
def test_plan_invariants_and_attention_through_arrays(query_lens: list[int], seq_lens: list[int],
                                                      block_size: int) -> None:
    case = make_case(query_lens, seq_lens, num_heads=6, kv_heads=2, head_dim=8, block_size=block_size)
    # pad every block table with extra zeros, as the engine's batched tables are
    width = max(len(t) for t in case.tables) + 2
    tables = [t + [0] * (width - len(t)) for t in case.tables]
    meta = AttentionMetadata.build(block_size, query_lens, seq_lens, tables)
    plan = plan_flashinfer(meta)
    _check_invariants(plan, meta)
    assert (plan.token_order is None) == (plan.order == sorted(plan.order))
    kv = case.kv.clone()
    rows = kv.view(-1, 2, block_size, 2, 8)
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        rows[slot // block_size, 0, slot % block_size] = case.new_k[t]
        rows[slot // block_size, 1, slot % block_size] = case.new_v[t]
    out = _attend_through_plan(plan, case.q, kv, 8**-0.5)
    torch.testing.assert_close(out, case.expected, atol=1e-5, rtol=1e-5)


def test_plan_rejects_short_tables() -> None:
    meta = AttentionMetadata.build(16, [1], [20], [[3, 4]])
    meta.block_tables_list[0] = [3]
    with pytest.raises(ValueError, match="need 2 blocks"):
        plan_flashinfer(meta)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_and_softcap_through_flashinfer_parameters(window: int | None, softcap: float | None) -> None:
    """The plan parameters a layer's window and softcap become, read as flashinfer defines them, give the
    interface's attention (window W = W keys including the query's own; c * tanh(s / c))."""
    query_lens, seq_lens = [7, 1, 13, 1], [7, 40, 29, 17]
    case = make_case(query_lens, seq_lens, num_heads=6, kv_heads=2, head_dim=8, block_size=16, seed=1)
    q = case.q * 3  # scores past tanh's bend at cap 2
    meta = AttentionMetadata.build(16, query_lens, seq_lens, case.tables)
    variant = flashinfer_variant(window, None, softcap)
    assert variant == LayerVariant(-1 if window is None else window - 1, softcap or 0.0)
    kv = case.kv.clone()
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        kv[slot // 16, 0, slot % 16] = case.new_k[t]
        kv[slot // 16, 1, slot % 16] = case.new_v[t]
    out = _attend_through_plan(plan_flashinfer(meta), q, kv, 8**-0.5, variant)
    start = 0
    for q_len, fk, fv in zip(query_lens, case.full_k, case.full_v, strict=True):
        want = dense(q[start:start + q_len], fk, fv, window, None, softcap, scale=8**-0.5)
        torch.testing.assert_close(out[start:start + q_len].double(), want, atol=1e-5, rtol=1e-5)
        start += q_len


def test_plain_layers_keep_flashinfer_defaults_and_sinks_go_elsewhere() -> None:
    assert flashinfer_variant(None, None, None) == LayerVariant(window_left=-1, logits_soft_cap=0.0)
    assert flashinfer_variant(4096, None, None) == LayerVariant(window_left=4095)
    assert flashinfer_variant(128, torch.zeros(8), None) is None  # gpt-oss: the Triton kernels
    assert flashinfer_variant(None, torch.zeros(8), 30.0) is None
