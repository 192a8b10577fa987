"""Sliding windows, sinks and softcap on the CUDA attention backends against a dense float64 attention
(skipped without CUDA; not yet run on a GPU, README.md). flashinfer runs window and softcap itself
and hands layers with sinks to its Triton twin."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from kernels import get_attention_backend
from kernels.attention import AttentionMetadata
from tests.unit.attention_cases import make_case
from tests.unit.test_triton_attention_features import dense

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
SCALE = 128**-0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("window", "sinks", "softcap"), [
    (128, False, None), (1000, False, None), (None, False, 30.0), (128, True, None), (None, True, None),
])
def test_features_match_dense(backend: str, window: int | None, sinks: bool, softcap: float | None) -> None:
    case = make_case([1, 37, 1, 200], [90, 300, 17, 200], num_heads=32, kv_heads=8, head_dim=128,
                     block_size=16)
    meta = AttentionMetadata.build(16, case.meta.query_lens_list, case.meta.seq_lens_list,
                                   case.meta.block_tables_list, "cuda")
    sink = torch.randn(32, generator=torch.Generator().manual_seed(3)) if sinks else None
    attn: Any = get_attention_backend("cuda", backend)  # the interface's feature keywords
    attn.prepare(meta)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (case.q, case.new_k, case.new_v))
    out = attn.forward(q, k, v, case.kv.to("cuda", torch.bfloat16), SCALE, window=window,
                       sinks=None if sink is None else sink.cuda(), softcap=softcap)
    start, rows = 0, []
    for q_len, fk, fv in zip(case.meta.query_lens_list, case.full_k, case.full_v, strict=True):
        qs = case.q[start:start + q_len].bfloat16()
        rows.append(dense(qs, fk.bfloat16(), fv.bfloat16(), window, sink, softcap, scale=SCALE))
        start += q_len
    torch.testing.assert_close(out.double().cpu(), torch.cat(rows), atol=2e-2, rtol=2e-2)
