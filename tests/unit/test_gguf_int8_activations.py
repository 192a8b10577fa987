"""The int8-activation mode over GGUF blocks (``--gguf-activations int8``, ``kernels/cpu_qint8.c``).

The kernel's products are compared bitwise with ``int8_reference``, a torch model of the same arithmetic:
the activations quantized per block of 32 inputs (``d = amax / 127``, ``q = round(x * (127 / amax))``),
exact integer block sums (float64 sums of products below 2^24), then the float32 steps in the C order
over the blocks: ``s = d_w * d_a`` rounded, ``acc = fma(s, I, acc)`` (Q6_K: one per half of 16 inputs,
each with its own scale), then Q4_1's and the K formats' ``acc = fma(m_w, d_a * S, acc)``, and the bias.
Bitwise is the tolerance because every step is one correctly rounded float32 operation done in the same
order on both sides (``fma32`` rounds a fused multiply-add once, as vfmadd does). A served tiny model in
int8 mode gives the float32 mode's greedy tokens where the float32 picks are not near ties, on the
one-call decoder and the per-layer path; the mode is refused where it cannot apply.
"""
from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from bench.lab.kquants import quantize_any
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.causal_lm import CausalLM
from kernels.gguf_blocks import (
    BLOCK_BYTES,
    GGUF_KINDS,
    INT8_KINDS,
    K_KINDS,
    QK,
    BlockKind,
    BlockMatrix,
    fp8_matrix,
    k_parts,
)
from kernels.kmix import cat_rows
from kernels.linear import PreparedLinear
from kernels.native_ops import native_ops
from tests.families import agree_up_to_a_near_tie, prompt, save
from tests.gguf_families import write_gguf, write_q4_k_m
from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout
from worker.tp_kv import rank_layout

KINDS: dict[BlockKind, GGMLQuantizationType] = {
    kind: GGMLQuantizationType[kind.name] for kind in GGUF_KINDS}
LEGACY = [BlockKind.Q4_0, BlockKind.Q4_1, BlockKind.Q8_0]  # the kinds the tiny Llama's widths (64, 96) fit

_ops = native_ops()
pytestmark = pytest.mark.skipif(_ops is None or not _ops.int8_available,
                                reason="no native library with the int8 product (AVX512-VNNI) here")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[m, k]`` -> int8 codes ``[m, k / 32, 32]`` (as float64) and float32 scales ``[m, k / 32]``."""
    blocks = x.reshape(x.shape[0], -1, QK)
    amax = blocks.abs().amax(-1)
    scale = amax / torch.full_like(amax, 127.0)  # tensor / tensor: a true division (not a reciprocal)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inverse[..., None])  # ties to even, as vcvtps2dq
    return codes.double(), scale


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of float32 tensors rounded once to float32, as a fused multiply-add: the product is
    exact in float64 (24 + 24 bits), the sum is rounded to odd there (TwoSum's error moves an inexact
    even result one ulp towards it), and rounding that to float32 is then correct (53 >= 24 + 2 bits)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, torch.inf), torch.full_like(s, -torch.inf))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def int8_reference(x: torch.Tensor, matrix: BlockMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """The int8-activation product of ``x`` ``[m, in]`` and ``matrix`` in torch (the module docstring)."""
    n, k = matrix.shape
    qa, da = quantize_rows(x)
    terms = _k_terms(qa, da, matrix) if matrix.kind in K_KINDS else _legacy_terms(qa, da, matrix)
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // QK):
        for scale, value in terms:
            acc = fma32(scale[..., b], value[..., b], acc)
    return acc if bias is None else acc + bias


Terms = list[tuple[torch.Tensor, torch.Tensor]]  # each block's fused multiply-adds, in order: [m, n, blocks]


def _min_term(qa: torch.Tensor, da: torch.Tensor, mins: torch.Tensor,
              n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``m_w`` and ``d_a * S`` (rounded), broadcast to ``[m, n, blocks]``."""
    ds = (da * qa.sum(-1).float())[:, None].expand(-1, n, -1)
    return mins[None].expand(qa.shape[0], -1, -1), ds


def _k_terms(qa: torch.Tensor, da: torch.Tensor, matrix: BlockMatrix) -> Terms:
    """A K format's terms: Q4_K and Q5_K as Q4_1 (float32 scales); Q6_K's and KMIX's two halves
    ``(d_w0 * d_a, I0)`` and ``(d_w1 * d_a, I1)``, then their min's."""
    n = matrix.shape[0]
    codes, scales, mins = k_parts(matrix.kind, matrix.rows, matrix.shape[1])
    if matrix.kind in (BlockKind.Q4_K, BlockKind.Q5_K):
        sums = torch.einsum("mbj,nbj->mnb", qa, codes.double()).float()
        terms = [(scales[None, ..., 0] * da[:, None], sums)]
    else:
        half = QK // 2
        weights = codes.double() - 32
        lo = torch.einsum("mbj,nbj->mnb", qa[..., :half], weights[..., :half]).float()
        hi = torch.einsum("mbj,nbj->mnb", qa[..., half:], weights[..., half:]).float()
        terms = [(scales[None, ..., 0] * da[:, None], lo), (scales[None, ..., 1] * da[:, None], hi)]
    return [*terms, _min_term(qa, da, mins, n)]


def _legacy_terms(qa: torch.Tensor, da: torch.Tensor, matrix: BlockMatrix) -> Terms:
    n, k = matrix.shape
    raw = matrix.rows.reshape(n, k // QK, BLOCK_BYTES[matrix.kind])
    dw = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [n, blocks]
    with_m = matrix.kind in (BlockKind.Q4_1, BlockKind.Q5_1)
    five = matrix.kind in (BlockKind.Q5_0, BlockKind.Q5_1)
    start = 4 if with_m else 2
    if matrix.kind == BlockKind.Q8_0:
        weights = raw[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = raw[..., start + (4 if five else 0):].to(torch.int64)
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # elements 0..15, then 16..31
        if five:  # the fifth bits: bit e of a little-endian word
            word = raw[..., start:start + 4].to(torch.int64)
            bits = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
            codes = codes | ((bits[..., None] >> torch.arange(QK)) & 1) << 4
        offset = {BlockKind.Q4_0: 8, BlockKind.Q5_0: 16}.get(matrix.kind, 0)
        weights = (codes - offset).double()
    sums = torch.einsum("mbj,nbj->mnb", qa, weights).float()  # exact: every |sum| < 2^24
    terms = [(dw[None] * da[:, None], sums)]
    if with_m:
        mw = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        terms.append(_min_term(qa, da, mw, n))
    return terms


def _blocks(kind: BlockKind, out_features: int, in_features: int, seed: int) -> BlockMatrix:
    if kind == BlockKind.KMIX:  # rows of Q4_K, Q6_K, Q8_0 (codes up to 255) and Q4_0, in turn
        kinds = (BlockKind.Q4_K, BlockKind.Q6_K, BlockKind.Q8_0, BlockKind.Q4_0)
        parts = [_blocks(kinds[row % 4], 1, in_features, seed + row) for row in range(out_features)]
        joined = cat_rows(parts)
        assert joined is not None and joined.kind == BlockKind.KMIX
        return joined
    rng = np.random.default_rng(seed)
    raw = quantize_any(rng.standard_normal((out_features, in_features), dtype=np.float32), KINDS[kind])
    return BlockMatrix(kind, torch.from_numpy(raw.copy()), in_features)


@pytest.mark.parametrize("kind", INT8_KINDS)
def test_int8_products_are_the_reference_bitwise(kind: BlockKind) -> None:
    assert _ops is not None
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(int(kind))
    try:
        # ragged widths; 8192 inputs: chunks of 32 rows (cpu_qint8.c's MC_BYTES), so 40 rows take two
        shapes = ((40, 64), (3, 32), (100, 160)) if kind in LEGACY else ((40, 256), (3, 512), (100, 256))
        for out_features, in_features in (*shapes, (3, 8192)):
            matrix = _blocks(kind, out_features, in_features, seed=out_features)
            packed = _ops.qpack(matrix)
            bias = torch.randn(out_features, generator=gen)
            for rows in (1, 2, 7, 8, 9, 16, 38, 40):  # 32 rows and more: Q4 codes in tiles of two panels
                x = torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
                x[0, :QK] = 0  # a block of zeros: scale 0, codes 0
                for b in (None, bias):
                    want = int8_reference(x, matrix, b)
                    for n_threads in (1, 2):
                        torch.set_num_threads(n_threads)
                        got = _ops.qpacked_linear(x, packed, kind, out_features, b, int8=True)
                        assert torch.equal(got, want), (out_features, in_features, rows, n_threads)
                    # each row's values alone: the same bits at any row count
                    assert torch.equal(_ops.qpacked_linear(x[-1:], packed, kind, out_features, b, int8=True),
                                       want[-1:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", INT8_KINDS)
def test_int8_products_are_close_to_float32(kind: BlockKind) -> None:
    """The int8 mode rounds the activations: close to the float32 product, not equal to it."""
    assert _ops is not None
    matrix = _blocks(kind, 64, 256, seed=7)
    packed = _ops.qpack(matrix)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    got = _ops.qpacked_linear(x, packed, matrix.kind, 64, None, int8=True)
    want = _ops.qpacked_linear(x, packed, matrix.kind, 64, None)
    assert not torch.equal(got, want)
    assert (got - want).norm() < 0.02 * want.norm()


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama (its head scaled by ``tests.families.HEAD_SCALE``) as a GGUF file of each kind it
    fits, and the wide one as a Q4_K_M file."""
    root = tmp_path_factory.mktemp("int8")
    save("llama", root / "hf")
    files = {kind.name: write_gguf(root / "hf", root / f"{kind.name}.gguf", KINDS[kind]) for kind in LEGACY}
    files["Q4_K_M"] = write_q4_k_m(root)
    return files


def _model(llm: LLM) -> CausalLM:
    return llm.engine.runner.model


Run = list[tuple[list[int], list[list[tuple[int, float]]]]]
PROMPTS = [prompt(3 + 7 * seed % 40, seed) for seed in range(16)]
MARGIN = 1.5  # logprob gap of the float32 picks compared: int8's logprobs stay within ~0.5 of float32's here


def _run(llm: LLM) -> Run:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, [t.top for t in o.logprobs or [] if t is not None]) for o in outs]


@pytest.mark.parametrize("name", [kind.name for kind in LEGACY])
def test_served_int8_model_picks_the_float32_tokens_away_from_ties(llama_files: dict[str, Path],
                                                                   name: str) -> None:
    int8 = LLM(str(llama_files[name]), num_threads=2, gguf_activations="int8")
    floats = LLM(str(llama_files[name]), num_threads=2)
    try:
        model = _model(int8)
        assert model.int8_activations and model.lm_head_linear.int8_activations  # the head's product too
        assert model.execution_path == "one native call per step (every layer fused)"
        assert not _model(floats).int8_activations
        # the numerics a worker publishes for KV transfers (transfer/compat.py)
        assert rank_layout(int8.engine.runner, "m").numerics == "int8"
        assert rank_layout(floats.engine.runner, "m").numerics == "float32"
        assert model.weight_bytes() == _model(floats).weight_bytes()  # the same records, no copy
        got, want = _run(int8), _run(floats)
        assert got != want  # another arithmetic
        compared = sum(agree_up_to_a_near_tie(tokens, float_tokens, tops, MARGIN)
                       for (tokens, _), (float_tokens, tops) in zip(got, want, strict=True))
        assert compared >= 20
        # the per-layer path (no one-call decoder) computes the same bits
        model.use_native_decoder = False
        assert _run(int8) == got
    finally:
        int8.close()
        floats.close()


def test_served_int8_k_quants_take_the_one_call_decoder(llama_files: dict[str, Path]) -> None:
    """A Q4_K_M file in int8 mode: every product over its blocks (layer 0's QKV mixing Q4_K and Q6_K rows)
    in one native call per step, bitwise the per-layer path. (The wide random model amplifies any rounding
    too much for a token comparison with float32: the products' values are held to ``int8_reference``
    above.)"""
    int8 = LLM(str(llama_files["Q4_K_M"]), num_threads=2, gguf_activations="int8",
               enable_prefix_caching=False)
    try:
        model = _model(int8)
        assert model.int8_activations and model.lm_head_linear.kind == BlockKind.Q4_K
        assert model.execution_path == "one native call per step (every layer fused)"
        layer = model.decoder_layers()[0]
        assert layer.attn.qkv_linear.kind == BlockKind.KMIX  # type: ignore[union-attr]
        assert layer.mlp.down_linear.kind == BlockKind.Q6_K  # type: ignore[union-attr]
        got = _run(int8)
        assert all(len(tokens) == 8 for tokens, _ in got)
        model.use_native_decoder = False
        assert _run(int8) == got
    finally:
        int8.close()


def test_int8_activations_are_refused_where_they_cannot_apply() -> None:
    with pytest.raises(ValueError, match="--gguf-activations int8 applies .* --dtype float32"):
        EngineConfig(dtype="float32", gguf_activations="int8")
    with pytest.raises(ValueError, match="--native-kernels"):
        EngineConfig(gguf_activations="int8", native_kernels=False)
    with pytest.raises(ValueError, match="--linear-kernel native"):
        EngineConfig(gguf_activations="int8", linear_kernel="prepacked")
    with pytest.raises(ValueError, match="--gguf-activations must be one of float32, int8"):
        EngineConfig(gguf_activations="int4")
    EngineConfig(dtype="float32", gguf_activations="float32")


def test_a_cpu_without_vnni_refuses_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _ops is not None
    matrix = _blocks(BlockKind.Q8_0, 16, 32, seed=1)
    linear = PreparedLinear(torch.zeros(16, 32), None, "native", matrix)
    assert linear.packed is not None
    monkeypatch.setattr(_ops, "int8_available", False)
    with pytest.raises(ValueError, match="avx512_vnni"):
        linear.set_int8_activations(True)
    with pytest.raises(ValueError, match="avx512_vnni"):
        _ops.qpacked_linear(torch.zeros(1, 32), linear.packed, matrix.kind, 16, None, int8=True)
    linear.set_int8_activations(False)
    assert not linear.int8_activations


def test_fp8_codes_have_no_int8_product() -> None:
    assert _ops is not None
    matrix = fp8_matrix(torch.ones(16, 32).to(torch.float8_e4m3fn), torch.ones(16, 1))
    with pytest.raises(ValueError, match="FP8"):
        _ops.qpacked_linear(torch.zeros(1, 32), _ops.qpack(matrix), matrix.kind, 16, None, int8=True)


def test_int8_activations_are_part_of_transfer_compatibility() -> None:
    layout = KvLayout("m", "float32", 2, 8, 16, 2, 16, 4)
    int8 = msgspec.structs.replace(layout, numerics="int8")
    assert compat_hash(int8) != compat_hash(layout)
    info = AgentInfo(WIRE_VERSION, compat_hash(int8), "peer", b"", 0, 0, "DRAM", int8)
    with pytest.raises(IncompatibleKvError, match="numerics"):
        check_compatible(layout, info)

