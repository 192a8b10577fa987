"""Latent attention's two forms on one paged latent cache: the absorbed form (decode rows) equals the
expanded form (prompt chunks), and both equal dense attention over the up-projected keys and values.

Tolerances: float32 within 2e-5 of the output's scale (the forms sum the same products in another
order); bfloat16 caches within 2e-2 (their latents are rounded to 8 bits of mantissa once, when
written, and both forms read the same rounded rows; the rest is float32 arithmetic). A quantized latent
(int8, fp8) is read back dequantized by both forms alike: they agree as in float32, and equal dense
attention over the dequantized rows."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.kv_quant import dequantize, qmax
from kernels.mla import MlaTorchBackend

HEADS, NOPE, ROPE, V, RANK, BS = 4, 16, 8, 12, 32, 4


def _case(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w_uk": torch.randn(HEADS, NOPE, RANK, generator=g) / RANK**0.5,
            "w_uv": torch.randn(HEADS, V, RANK, generator=g) / RANK**0.5,
            "cache": torch.zeros(12, 1, BS, 1, RANK + ROPE, dtype=dtype)}


def _run(backend: MlaTorchBackend, case: dict[str, torch.Tensor], meta: AttentionMetadata,
         seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = meta.num_tokens
    q_nope = torch.randn(tokens, HEADS, NOPE, generator=g)
    q_rope = torch.randn(tokens, HEADS, ROPE, generator=g)
    latent = torch.randn(tokens, RANK + ROPE, generator=g)
    backend.prepare(meta)
    return backend.forward(q_nope, q_rope, latent, case["cache"], case["w_uk"], case["w_uv"], 0.3,
                           case.get("scales"))


def _dense(case: dict[str, torch.Tensor], table: list[int], length: int, q_nope: torch.Tensor,
           q_rope: torch.Tensor, scale: float) -> torch.Tensor:
    """The last query's attention, spelled out: keys and values up-projected from every cached row."""
    cache = case["cache"]
    if "scales" in case:
        cache = dequantize(cache, case["scales"][:, :, None, :, None])
    rows = torch.stack([cache[table[p // BS], 0, p % BS, 0].float() for p in range(length)])
    keys = torch.cat((torch.einsum("lr,hdr->hld", rows[:, :RANK], case["w_uk"]),
                      rows[None, :, RANK:].expand(HEADS, -1, -1)), dim=-1)
    values = torch.einsum("lr,hvr->hlv", rows[:, :RANK], case["w_uv"])
    scores = torch.einsum("hd,hld->hl", torch.cat((q_nope, q_rope), dim=-1), keys) * scale
    return torch.einsum("hl,hlv->hv", torch.softmax(scores, dim=-1), values)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_absorbed_equals_expanded_on_the_same_cache(dtype: torch.dtype, tol: float) -> None:
    tables = [[7, 2, 9], [4, 11]]
    prompt = AttentionMetadata.build(BS, [10, 6], [10, 6], tables)  # two prompt chunks write the cache
    step = AttentionMetadata.build(BS, [1, 1], [11, 7], tables)  # then one decode row each
    results = {}
    for absorb in (False, True):
        case = _case(dtype)
        _run(MlaTorchBackend(absorb=absorb), case, prompt, seed=1)
        results[absorb] = (_run(MlaTorchBackend(absorb=absorb), case, step, seed=2), case)
    (expanded, case), (absorbed, _) = results[False], results[True]
    scale = expanded.abs().max()
    assert torch.allclose(absorbed, expanded, atol=float(tol * scale), rtol=0)
    g = torch.Generator().manual_seed(2)
    q_nope, q_rope = torch.randn(2, HEADS, NOPE, generator=g), torch.randn(2, HEADS, ROPE, generator=g)
    for s, (table, length) in enumerate(zip(tables, (11, 7), strict=True)):
        dense = _dense(case, table, length, q_nope[s], q_rope[s], 0.3)
        assert torch.allclose(expanded[s], dense.to(expanded.dtype), atol=float(tol * scale), rtol=0)


def test_each_form_is_chosen_per_group_of_a_mixed_step() -> None:
    """A step of one prompt chunk and one decode row: the chunk expanded, the row absorbed, each equal
    to forcing that form on the whole step."""
    tables = [[3, 5], [8, 1, 6]]
    meta = AttentionMetadata.build(BS, [6, 1], [6, 9], tables)
    out = {}
    for absorb in (None, False, True):
        case = _case(torch.float32)
        _run(MlaTorchBackend(absorb=False), case, AttentionMetadata.build(BS, [8], [8], [tables[1]]), seed=4)
        out[absorb] = _run(MlaTorchBackend(absorb=absorb), case, meta, seed=5)
    assert torch.equal(out[None][:6], out[False][:6])
    assert torch.equal(out[None][6:], out[True][6:])
    assert torch.allclose(out[True], out[False], atol=float(2e-5 * out[False].abs().max()), rtol=0)



@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_quantized_latent_is_one_scale_per_block_and_both_forms_read_it_alike(dtype: torch.dtype) -> None:
    """Prompt chunks, then decode rows appended into their last blocks: every written latent comes back
    within half a code of its block's scale (int8) or fp8's relative step; both forms agree and equal
    dense attention over the dequantized rows."""
    tables = [[7, 2, 9], [4, 11]]
    g = torch.Generator().manual_seed(9)
    written = torch.randn(16 + 2, RANK + ROPE, generator=g)
    queries = [(torch.randn(n, HEADS, NOPE, generator=g), torch.randn(n, HEADS, ROPE, generator=g))
               for n in (16, 2)]
    steps = [AttentionMetadata.build(BS, [10, 6], [10, 6], tables),  # two prompt chunks
             AttentionMetadata.build(BS, [1, 1], [11, 7], tables)]  # a decode row each, into a written block
    results = {}
    for absorb in (False, True):
        case = {**_case(torch.float32), "cache": torch.zeros(12, 1, BS, 1, RANK + ROPE, dtype=dtype),
                "scales": torch.ones(12, 1, 1)}
        backend = MlaTorchBackend(absorb=absorb)
        for meta, rows, (q_nope, q_rope) in zip(steps, (written[:16], written[16:]), queries, strict=True):
            backend.prepare(meta)
            out = backend.forward(q_nope, q_rope, rows, case["cache"], case["w_uk"], case["w_uv"], 0.3,
                                  case["scales"])
        results[absorb] = (out, case)
    (expanded, case), (absorbed, _) = results[False], results[True]
    scale = float(expanded.abs().max())
    assert torch.allclose(absorbed, expanded, atol=2e-5 * scale, rtol=0)
    for s, (table, length) in enumerate(zip(tables, (11, 7), strict=True)):
        dense = _dense(case, table, length, queries[1][0][s], queries[1][1][s], 0.3)
        assert torch.allclose(expanded[s], dense, atol=2e-5 * scale, rtol=0)
    back = dequantize(case["cache"], case["scales"][:, :, None, :, None])
    order = [(0, p) for p in range(10)] + [(1, p) for p in range(6)] + [(0, 10), (1, 6)]
    for (s, p), row in zip(order, written, strict=True):
        block = tables[s][p // BS]
        block_scale = float(case["scales"][block, 0, 0])
        assert block_scale == pytest.approx(float(back[block, 0].abs().max()) / qmax(dtype), rel=1e-5)
        bound = block_scale / 2 if dtype == torch.int8 else 2**-3 * float(row.abs().max())
        assert float((back[block, 0, p % BS, 0] - row).abs().max()) <= bound * 1.0001, (s, p)
