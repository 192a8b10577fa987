"""The int8-activation mode over GGUF blocks (``--gguf-activations int8``, ``kernels/cpu_qint8.c``).

The kernel's products are compared bitwise with ``int8_reference``, a torch model of the same arithmetic:
the activations quantized per block of 32 inputs (``d = amax / 127``, ``q = round(x * (127 / amax))``),
exact integer block sums (float64 sums of products below 2^24), then the float32 steps in the C order,
each one IEEE rounding (``s = d_w * d_a``, ``t = s * I``, Q4_1's ``t + m_w * (d_a * S)``, the running sum
over the blocks, the bias). Bitwise is the tolerance because every step is a correctly rounded float32
operation done in the same order on both sides (the kernel uses no FMA there). A served tiny model in int8
mode gives the float32 mode's greedy tokens where the float32 picks are not near ties, on the one-call
decoder and the per-layer path; the mode is refused where it cannot apply.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.causal_lm import CausalLM
from kernels.gguf_blocks import BLOCK_BYTES, QK, BlockKind, BlockMatrix
from kernels.linear import PreparedLinear
from kernels.native_ops import native_ops
from tests.families import agree_up_to_a_near_tie, prompt, save
from tests.gguf_families import write_gguf
from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout
from worker.tp_kv import rank_layout

KINDS = {BlockKind.Q4_0: GGMLQuantizationType.Q4_0, BlockKind.Q4_1: GGMLQuantizationType.Q4_1,
         BlockKind.Q8_0: GGMLQuantizationType.Q8_0}

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


def int8_reference(x: torch.Tensor, matrix: BlockMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """The int8-activation product of ``x`` ``[m, in]`` and ``matrix`` in torch (the module docstring)."""
    n, k = matrix.shape
    raw = matrix.rows.reshape(n, k // QK, BLOCK_BYTES[matrix.kind])
    dw = raw[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [n, blocks]
    start = 4 if matrix.kind == BlockKind.Q4_1 else 2
    if matrix.kind == BlockKind.Q8_0:
        weights = raw[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = raw[..., start:]
        weights = torch.cat([qs & 15, qs >> 4], dim=-1).double()  # elements 0..15, then 16..31
        if matrix.kind == BlockKind.Q4_0:
            weights = weights - 8
    qa, da = quantize_rows(x)
    sums = torch.einsum("mbj,nbj->mnb", qa, weights).float()  # exact: every |sum| < 2^24
    t = (dw[None] * da[:, None]) * sums
    if matrix.kind == BlockKind.Q4_1:
        mw = raw[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        t = t + mw[None] * (da * qa.sum(-1).float())[:, None]
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // QK):
        acc = acc + t[..., b]
    return acc if bias is None else acc + bias


def _blocks(kind: BlockKind, out_features: int, in_features: int, seed: int) -> BlockMatrix:
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), KINDS[kind])
    return BlockMatrix(kind, torch.from_numpy(raw.copy()), in_features)


@pytest.mark.parametrize("kind", list(BlockKind))
def test_int8_products_are_the_reference_bitwise(kind: BlockKind) -> None:
    assert _ops is not None
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(int(kind))
    try:
        # ragged widths; 8192 inputs: chunks of 32 rows (cpu_qint8.c's MC_BYTES), so 40 rows take two
        for out_features, in_features in ((40, 64), (3, 32), (100, 160), (3, 8192)):
            matrix = _blocks(kind, out_features, in_features, seed=out_features)
            packed = _ops.qpack(matrix)
            bias = torch.randn(out_features, generator=gen)
            for rows in (1, 2, 7, 8, 9, 16, 40):
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


def test_int8_products_are_close_to_float32() -> None:
    """The int8 mode rounds the activations: close to the float32 product, not equal to it."""
    assert _ops is not None
    matrix = _blocks(BlockKind.Q4_0, 64, 256, seed=7)
    packed = _ops.qpack(matrix)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    got = _ops.qpacked_linear(x, packed, matrix.kind, 64, None, int8=True)
    want = _ops.qpacked_linear(x, packed, matrix.kind, 64, None)
    assert not torch.equal(got, want)
    assert (got - want).norm() < 0.02 * want.norm()


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[BlockKind, Path]:
    """The tiny Llama (its head scaled by ``tests.families.HEAD_SCALE``) as a GGUF file of each kept kind."""
    root = tmp_path_factory.mktemp("int8")
    save("llama", root / "hf")
    return {kind: write_gguf(root / "hf", root / f"{kind.name}.gguf", KINDS[kind]) for kind in BlockKind}


def _model(llm: LLM) -> CausalLM:
    return llm.engine.runner.model


Run = list[tuple[list[int], list[list[tuple[int, float]]]]]
PROMPTS = [prompt(3 + 7 * seed % 40, seed) for seed in range(16)]
MARGIN = 1.5  # logprob gap of the float32 picks compared: int8's logprobs stay within ~0.5 of float32's here


def _run(llm: LLM) -> Run:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, [t.top for t in o.logprobs or [] if t is not None]) for o in outs]


@pytest.mark.parametrize("kind", list(BlockKind))
def test_served_int8_model_picks_the_float32_tokens_away_from_ties(llama_files: dict[BlockKind, Path],
                                                                   kind: BlockKind) -> None:
    int8 = LLM(str(llama_files[kind]), num_threads=2, gguf_activations="int8")
    floats = LLM(str(llama_files[kind]), num_threads=2)
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


def test_int8_activations_are_part_of_transfer_compatibility() -> None:
    layout = KvLayout("m", "float32", 2, 8, 16, 2, 16, 4)
    int8 = msgspec.structs.replace(layout, numerics="int8")
    assert compat_hash(int8) != compat_hash(layout)
    info = AgentInfo(WIRE_VERSION, compat_hash(int8), "peer", b"", 0, 0, "DRAM", int8)
    with pytest.raises(IncompatibleKvError, match="numerics"):
        check_compatible(layout, info)

