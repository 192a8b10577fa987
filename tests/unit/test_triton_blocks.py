"""The Triton product over kept blocks (``kernels/triton_blocks.py``), run by Triton's interpreter on CPU:
every 32-input record kind against its dequantized weight, and fp8 and MXFP4 checkpoints served through it
(``--linear-kernel triton``, as CUDA devices run their kept blocks) with the tokens of the same model
dequantized to float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench.lab.kquants import quantize_any
from engine.config import EngineConfig
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.gguf_blocks import BLOCK_BYTES, BLOCK_INPUTS, K_KINDS, BlockKind, BlockMatrix, fp8_matrix
from kernels.kmix import cat_rows
from kernels.linear import PreparedLinear
from kernels.triton_blocks import triton_block_linear
from tests.families import MIN_MARGIN, clear_margin, hf_greedy, prompt
from tests.gguf_families import write_q4_k_m
from tests.unit.test_checkpoint_quant import fp8_checkpoint, mxfp4_checkpoint

GGUF_TYPES = {BlockKind.Q4_0: Q.Q4_0, BlockKind.Q4_1: Q.Q4_1, BlockKind.Q5_0: Q.Q5_0, BlockKind.Q5_1: Q.Q5_1,
              BlockKind.Q8_0: Q.Q8_0, BlockKind.Q4_K: Q.Q4_K, BlockKind.Q5_K: Q.Q5_K, BlockKind.Q6_K: Q.Q6_K}
STEPS = 8


def _matrix(kind: BlockKind, out_f: int, in_f: int, seed: int) -> BlockMatrix:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen)
    if kind == BlockKind.FP8:
        codes = (w * 60).clamp(-440, 440).to(torch.float8_e4m3fn)
        return fp8_matrix(codes, torch.rand(out_f, in_f // 32, generator=gen) + 0.01)
    if kind == BlockKind.KMIX:  # a fused matrix of mixed kinds: Q8_0 rows over Q6_K rows
        top = _matrix(BlockKind.Q8_0, out_f // 2, in_f, seed)
        fused = cat_rows([top, _matrix(BlockKind.Q6_K, out_f - out_f // 2, in_f, seed + 1)])
        assert fused is not None
        return fused
    rows = torch.from_numpy(quantize_any(w.numpy(), GGUF_TYPES[kind])).view(torch.uint8)
    return BlockMatrix(kind, rows.reshape(out_f, -1).contiguous(), in_f)


@pytest.mark.parametrize("kind", [*GGUF_TYPES, BlockKind.FP8, BlockKind.KMIX], ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_the_block_product_is_the_dequantized_weights_product(kind: BlockKind, rows: int) -> None:
    """70 outputs (a partial tile) over 96 inputs (three records a row; 512, two super-blocks, for the
    K kinds), with a bias; 1 and 7 rows take the decode tile, 40 the prompt tile. Every record's fields are
    read where they lie: a wrong nibble, fifth bit, scale or minimum moves the result far past float32
    rounding."""
    width = 512 if kind in K_KINDS else 96
    matrix = _matrix(kind, 70, width, seed=rows)
    assert matrix.kind == kind and matrix.rows.shape == (70, width // BLOCK_INPUTS[kind] * BLOCK_BYTES[kind])
    gen = torch.Generator().manual_seed(100 + rows)
    x, bias = torch.randn(rows, width, generator=gen), torch.randn(70, generator=gen)
    w = matrix.dequantize().double()
    want = x.double() @ w.T + bias.double()
    got = triton_block_linear(x, matrix.rows, kind, 70, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 70)
    scale = x.double().abs() @ w.abs().T + bias.double().abs()
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-6).all()
    # leading dimensions pass through, and 16-bit activations come back in their dtype
    half = triton_block_linear(x.to(torch.bfloat16).view(1, rows, width), matrix.rows, kind, 70)
    assert half.dtype == torch.bfloat16 and half.shape == (1, rows, 70)
    want16 = x.to(torch.bfloat16).double() @ w.T
    assert ((half[0].double() - want16).abs() <= 1e-2 * (scale + 1)).all()


def test_the_block_product_refuses_what_it_cannot_read() -> None:
    matrix = _matrix(BlockKind.Q8_0, 8, 64, seed=0)
    with pytest.raises(ValueError, match="do not hold a"):
        triton_block_linear(torch.zeros(2, 32), matrix.rows, BlockKind.Q8_0, 8)
    kept = PreparedLinear(torch.zeros(8, 64), None, "triton", matrix)
    assert kept.triton and kept.kind == BlockKind.Q8_0 and kept.packed is not None
    assert torch.equal(kept.unpacked(), matrix.dequantize())


def test_triton_products_need_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--linear-kernel triton runs Triton kernels"):
        EngineConfig(linear_kernel="triton")


def _tokens(folder: Path, ids: list[list[int]], steps: int = STEPS, **kw: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(folder), block_size=4, num_kv_blocks=64, **kw)
    outs = llm.generate(ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    return llm, [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("scheme", ["block32", "channel", "tensor"])
def test_fp8_checkpoint_through_the_triton_product(tmp_path: Path, scheme: str) -> None:
    """Every linear keeps its codes (36 bytes a 32-weight record, no padding) and the Triton product gives
    transformers' greedy tokens on the dequantized weights, in less memory than the float32 model."""
    model = fp8_checkpoint(tmp_path, scheme)
    ids = [prompt(n, seed=n) for n in (5, 19)]
    ref = [hf_greedy(model, p, STEPS) for p in ids]
    assert min(clear_margin(model, p, r) for p, r in zip(ids, ref, strict=True)) > MIN_MARGIN
    llm, got = _tokens(tmp_path, ids, linear_kernel="triton")
    floats, _ = _tokens(tmp_path, ids[:1], dtype="float32")
    try:
        net = llm.engine.runner.model
        layer = net.decoder_layers()[0]
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
        for lin in (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear):
            assert lin.triton and lin.kind == BlockKind.FP8 and lin.packed is not None
            assert lin.packed.shape == (lin.out_features, lin.in_features // 32 * 36)
        assert "Triton products over the kept blocks" in net.execution_path
        assert not net.host_synced  # a dense model's steps can be captured in CUDA graphs
        assert net.weight_bytes() < floats.engine.runner.model.weight_bytes()
        assert got == ref
    finally:
        llm.close()
        floats.close()


def test_a_q4_k_m_file_through_the_triton_product(tmp_path: Path) -> None:
    """llama.cpp's common mix (Q4_K, Q6_K for the down projections and layer 0's V, so that layer's QKV is
    KMIX) kept as its blocks gives the file's dequantized float32 model's greedy tokens."""
    path = write_q4_k_m(tmp_path)
    ids = [prompt(7, seed=3)]
    llm, got = _tokens(path, ids, linear_kernel="triton", steps=4)
    floats, want = _tokens(path, ids, dtype="float32", steps=4)
    try:
        layers = llm.engine.runner.model.decoder_layers()
        kinds = []
        for layer in layers:
            attn, mlp = layer.attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
            kinds.append([lin.kind for lin in (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear,
                                               mlp.down_linear)])
            assert all(lin.triton for lin in (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear,
                                               mlp.down_linear))
        q4, q6 = BlockKind.Q4_K, BlockKind.Q6_K
        assert kinds == [[BlockKind.KMIX, q4, q4, q6], [q4, q4, q4, q6]]
        assert got == want
    finally:
        llm.close()
        floats.close()


def test_mxfp4_experts_through_the_triton_product(tmp_path: Path) -> None:
    """gpt-oss's MXFP4 experts run on their Q5_0 records, one expert's Triton products at a time, with
    transformers' greedy tokens on the dequantized weights."""
    model = mxfp4_checkpoint(tmp_path)
    ids = [prompt(n, seed=n) for n in (5, 19)]
    ref = [hf_greedy(model, p, STEPS) for p in ids]
    assert min(clear_margin(model, p, r) for p, r in zip(ids, ref, strict=True)) > MIN_MARGIN
    llm, got = _tokens(tmp_path, ids, linear_kernel="triton")
    try:
        moe = llm.engine.runner.model.decoder_layers()[0].mlp
        assert isinstance(moe, MoE) and moe.triton_experts
        assert llm.engine.runner.model.host_synced  # routed on the host: no CUDA graphs
        assert {lin.kind for lin in (*moe.w13_linears, *moe.w2_linears)} == {BlockKind.Q5_0}
        assert all(lin.triton for lin in (*moe.w13_linears, *moe.w2_linears))
        assert got == ref
    finally:
        llm.close()
