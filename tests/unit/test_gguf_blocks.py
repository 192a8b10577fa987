"""GGUF weights kept in their blocks (``kernels/gguf_blocks.py``, ``kernels/cpu_qpacked.c``): the products
over Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks (and KMIX, Q4_K and Q6_K rows fused) are bitwise the float32
packed products of the dequantized weights (any row count, thread count, bias, ragged width), and a model
served from its blocks (``--dtype auto``, the default for a GGUF) gives bitwise the logprobs of the same
file dequantized (``--dtype float32``), in a fraction of the memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bench.lab.kquants import quantize_any
from engine import LLM, SamplingParams
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.models.causal_lm import CausalLM
from kernels.gguf_blocks import GGUF_KINDS, BlockKind, BlockMatrix, fp8_matrix
from kernels.kmix import cat_rows, mixed
from kernels.linear import PreparedLinear
from kernels.native_ops import native_ops
from tests.families import prompt, save
from tests.gguf_families import write_gguf, write_q4_k_m

KINDS: dict[BlockKind, GGMLQuantizationType] = {
    kind: GGMLQuantizationType[kind.name] for kind in GGUF_KINDS}
LEGACY = [BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q8_0]  # the kinds the tiny Llama's widths (64, 96) fit
SMALL = (*LEGACY, BlockKind.Q5_0, BlockKind.Q5_1, BlockKind.FP8)  # the kinds of 32-input blocks
MEMORY = {BlockKind.Q4_0: 18, BlockKind.Q4_1: 20, BlockKind.Q8_0: 34, BlockKind.Q4_K: 24,
          BlockKind.Q6_K: 44, BlockKind.KMIX: 44, BlockKind.FP8: 36, BlockKind.Q5_0: 22,
          BlockKind.Q5_1: 24, BlockKind.Q5_K: 28}  # packed bytes per 32 weights

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernel library cannot be built here")


def _blocks(kind: BlockKind, out_features: int, in_features: int,
            seed: int) -> tuple[BlockMatrix, torch.Tensor]:
    """Random weights quantized by gguf, and gguf's own dequantization of them (KMIX: a Q4_K part, a Q6_K
    part and another Q4_K part stacked, as a fused QKV of a Q4_K_M file)."""
    if kind == BlockKind.KMIX:
        sizes = (out_features // 3, out_features - 2 * (out_features // 3), out_features // 3)
        kinds = (BlockKind.Q4_K, BlockKind.Q6_K, BlockKind.Q4_K)
        parts = [_blocks(part, rows, in_features, seed + i)
                 for i, (part, rows) in enumerate(zip(kinds, sizes, strict=True))]
        joined = cat_rows([matrix for matrix, _ in parts])
        assert joined is not None and joined.kind == BlockKind.KMIX
        return joined, torch.cat([reference for _, reference in parts])
    if kind == BlockKind.FP8:  # every code but the NaNs (the loader keeps none), subnormals and -0 included
        gen = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8, generator=gen)
        bits[0] = torch.arange(in_features) % 256
        bits[(bits & 0x7F) == 0x7F] = 0x38
        codes = bits.view(torch.float8_e4m3fn)
        scales = torch.rand(out_features, in_features // 32, generator=gen) * 0.01
        return fp8_matrix(codes, scales), codes.float() * scales.repeat_interleave(32, dim=1)
    rng = np.random.default_rng(seed)
    raw = quantize_any(rng.standard_normal((out_features, in_features), dtype=np.float32), KINDS[kind])
    reference = np.asarray(dequantize(raw, KINDS[kind]), dtype=np.float32).reshape(out_features, in_features)
    return BlockMatrix(kind, torch.from_numpy(raw.copy()), in_features), torch.from_numpy(reference.copy())


@pytest.mark.parametrize("kind", list(BlockKind))
def test_products_are_the_dequantized_float32_products_bitwise(kind: BlockKind) -> None:
    ops = native_ops()
    assert ops is not None
    threads = torch.get_num_threads()
    try:
        shapes = ((40, 64), (3, 32), (100, 160)) if kind in SMALL else ((40, 256), (3, 512), (100, 256))
        for out_features, in_features in shapes:
            matrix, reference = _blocks(kind, out_features, in_features, seed=out_features)
            assert torch.equal(matrix.dequantize(), reference)
            ids = torch.tensor([out_features - 1, 0, 1])
            assert torch.equal(matrix.lookup(ids), reference[ids])
            packed = ops.qpack(matrix)
            assert packed.dtype == torch.uint8 and packed.numel() == -(-out_features // 16) * 16 * (
                in_features // 32 * MEMORY[kind])  # the last panel padded
            assert torch.equal(ops.qunpack(packed, kind, out_features), reference)
            floats = ops.pack(reference)
            bias = torch.randn(out_features)
            for rows in (1, 2, 7, 8, 9, 16, 40, 300):  # the register tile and the scratch path
                x = torch.randn(rows, in_features)
                for n_threads in (1, 2):
                    torch.set_num_threads(n_threads)
                    for b in (None, bias):
                        got = ops.qpacked_linear(x, packed, kind, out_features, b)
                        want = ops.packed_linear(x, floats, out_features, b)
                        assert torch.equal(got, want), (rows, n_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("source", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q4_K", "Q6_K"])
def test_every_gguf_type_as_kmix_rows_keeps_its_values(source: str) -> None:
    """A matrix of each type in ``KMIX`` rows (how a fused matrix of mixed kinds is kept): gguf's
    dequantized values exactly, and their float32 product bitwise."""
    ops = native_ops()
    assert ops is not None
    in_features = 256 if source.endswith("_K") else 96
    x = np.random.default_rng(len(source)).standard_normal((37, in_features), dtype=np.float32)
    raw = np.ascontiguousarray(quantize_any(x, GGMLQuantizationType[source]))
    reference = torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[source]),
                                            dtype=np.float32).reshape(37, in_features).copy())
    matrix = mixed(BlockMatrix(BlockKind[source], torch.from_numpy(raw), in_features))
    assert matrix.kind == BlockKind.KMIX and torch.equal(matrix.dequantize(), reference)
    packed, floats = ops.qpack(matrix), ops.pack(reference)
    assert torch.equal(ops.qunpack(packed, matrix.kind, 37), reference)
    for count in (1, 9):
        rows_in = torch.randn(count, in_features)
        assert torch.equal(ops.qpacked_linear(rows_in, packed, matrix.kind, 37, None),
                           ops.packed_linear(rows_in, floats, 37, None))


def test_blocks_refuse_what_they_are_not() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        BlockMatrix(BlockKind.Q8_0, torch.zeros(2, 34, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="expected uint8"):
        BlockMatrix(BlockKind.Q4_1, torch.zeros(2, 34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        BlockMatrix(BlockKind.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 128)
    q8 = BlockMatrix(BlockKind.Q8_0, torch.zeros(2, 272, dtype=torch.uint8), 256)
    fp8 = fp8_matrix(torch.zeros(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 8))
    assert cat_rows([fp8, q8]) is None  # GGUF kinds mix, an fp8 checkpoint's codes do not


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama as GGUF files of each kept kind, and one whose Q rows alone are in blocks (its fused
    QKV mixes blocks and floats)."""
    root = tmp_path_factory.mktemp("blocks")
    folder = root / "hf"
    save("llama", folder)
    files = {kind.name: write_gguf(folder, root / f"{kind.name}.gguf", KINDS[kind]) for kind in LEGACY}
    files["mixed"] = write_gguf(folder, root / "mixed.gguf", GGMLQuantizationType.Q8_0, only="attn_q")
    files["Q4_K_M"] = write_q4_k_m(root)
    # a file of several kinds: QKV and gate/up fuse parts of different kinds (KMIX rows), down is Q5_0;
    # output and the embedding Q4_0
    q = GGMLQuantizationType
    files["mixed_gguf"] = write_gguf(folder, root / "mixed_gguf.gguf", q.Q4_0, types={
        "attn_q": q.Q8_0, "attn_v": q.Q5_0, "ffn_gate": q.Q4_1, "ffn_up": q.Q5_1, "ffn_down": q.Q5_0})
    return files


def _model(llm: LLM) -> CausalLM:
    return llm.engine.runner.model


def _linears(model: CausalLM) -> list[PreparedLinear]:
    """The first layer's four products: qkv, o, gate/up, down."""
    layer = model.decoder_layers()[0]
    attn, mlp = layer.attn, layer.mlp
    assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
    return [attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear]


def _matrices(layer: DecoderLayer) -> list[torch.Tensor]:
    attn, mlp = layer.attn, layer.mlp
    assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
    return [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj]


def _run(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
    outs = llm.generate([prompt(length, seed) for length, seed in ((9, 1), (40, 2), (3, 3))], params)
    return [(o.token_ids, [t.top for t in o.logprobs or [] if t is not None]) for o in outs]


Q4_K_M_KINDS = [BlockKind.KMIX, BlockKind.Q4_K, BlockKind.Q4_K, BlockKind.Q6_K, BlockKind.Q4_K]
MIXED_KINDS = [BlockKind.KMIX, BlockKind.Q4_0, BlockKind.KMIX, BlockKind.Q5_0, BlockKind.Q4_0]


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "mixed", "Q4_K_M", "mixed_gguf"])
def test_served_from_blocks_equals_dequantized_float32(llama_files: dict[str, Path], name: str) -> None:
    blocks = LLM(str(llama_files[name]), num_threads=2)  # dtype auto: the file's blocks
    floats = LLM(str(llama_files[name]), dtype="float32", num_threads=2)
    try:
        kept, dequantized = _model(blocks), _model(floats)
        kinds = [lin.kind for lin in (*_linears(kept), kept.lm_head_linear)]
        if name == "mixed":  # the fused QKV dequantized (its rows differ in kind); the rest are floats
            assert kinds == [None, None, None, None, None]
        else:
            if name == "Q4_K_M":  # layer 0's QKV mixes Q4_K and Q6_K rows; layer 1's is Q4_K
                assert kinds == Q4_K_M_KINDS
                assert kept.decoder_layers()[1].attn.qkv_linear.kind == BlockKind.Q4_K  # type: ignore[union-attr]
            elif name == "mixed_gguf":
                assert kinds == MIXED_KINDS
            else:
                assert kinds == [BlockKind[name]] * 5
            assert kept.execution_path == "one native call per step (every layer fused)"
            assert kept.weight_bytes() < dequantized.weight_bytes() / 2.5
        assert all(lin.kind is None for lin in (*_linears(dequantized), dequantized.lm_head_linear))
        got, want = _run(blocks), _run(floats)
        assert got == want  # tokens and top-5 logprobs, bitwise
        assert all(len(tokens) == 12 for tokens, _ in got)
        # the per-layer path (no one-call decoder) computes the same bits as the float32 model's (both runs
        # reuse their first run's prefix cache alike: with the wide model's head size, a prompt chunk's
        # blocked attention rounds otherwise than the row kernel of a shorter chunk)
        kept.use_native_decoder = dequantized.use_native_decoder = False
        assert _run(blocks) == _run(floats)
        # the plain matrices back from the blocks (the compiled path reads them) are the float32 model's
        kept.restore_plain_weights()
        for mine, theirs in zip(kept.decoder_layers(), dequantized.decoder_layers(), strict=True):
            theirs.restore_plain()
            for a, b in zip(_matrices(mine), _matrices(theirs), strict=True):
                assert torch.equal(a, b)
        assert torch.equal(kept.embed_tokens, dequantized.embed_tokens)
    finally:
        blocks.close()
        floats.close()


def test_default_model_is_served_from_its_blocks() -> None:
    """The default model (Q4_1 layers, a Q8_0 embedding) is served from its blocks by default, with the
    float32 model's tokens."""
    blocks = LLM(num_threads=2)
    floats = LLM(dtype="float32", num_threads=2)
    try:
        kept, dequantized = _model(blocks), _model(floats)
        assert _linears(kept)[3].kind == BlockKind.Q4_1 and kept.lm_head_linear.kind == BlockKind.Q8_0
        assert kept.weight_bytes() < 130e6 < 500e6 < dequantized.weight_bytes()
        params = SamplingParams(max_tokens=24, temperature=0.0)
        prompts = ["The capital of France is", "def add(a, b):"]
        assert ([o.token_ids for o in blocks.generate(prompts, params)]
                == [o.token_ids for o in floats.generate(prompts, params)])
    finally:
        blocks.close()
        floats.close()
