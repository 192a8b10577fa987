"""The Triton product over kept quantized weights (``kernels/triton_blocks.py``) on CUDA: each record kind
against its dequantized weight's product at model-like sizes in bfloat16, and an fp8 checkpoint served on
the device from its codes with the tokens of the same checkpoint dequantized to bfloat16 (skipped without
CUDA; not yet run on a GPU, docs/gpu.md; the interpreter runs the same checks on CPU:
tests/unit/test_triton_blocks.py).

Tolerance: the bfloat16 activations' rounding, ``2**-8`` of ``|x| @ |W|``; the codes themselves are exact in
bfloat16 and the sums float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.gguf_blocks import BlockKind
from kernels.triton_blocks import triton_block_linear
from tests.families import prompt
from tests.unit.test_checkpoint_quant import fp8_checkpoint
from tests.unit.test_triton_blocks import GGUF_TYPES, _matrix

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kind", [*GGUF_TYPES, BlockKind.FP8], ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_block_product_matches_the_dequantized_weight(kind: BlockKind, rows: int) -> None:
    matrix = _matrix(kind, 4096, 4096, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4096, generator=gen).bfloat16()
    w = matrix.dequantize().double()
    want = x.double() @ w.T
    got = triton_block_linear(x.cuda(), matrix.rows.cuda(), kind, 4096).cpu()
    assert got.dtype == torch.bfloat16
    bound = 2**-8 * (x.double().abs() @ w.abs().T) + 1e-3
    assert ((got.double() - want).abs() <= bound).all()


def test_fp8_checkpoint_runs_from_its_codes_on_the_device(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path, "block32")
    ids = [prompt(n, seed=n) for n in (5, 19)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs, held = [], []
    for dtype in ("auto", "bfloat16"):  # the codes, then the checkpoint dequantized to bfloat16
        llm = LLM(model=str(tmp_path), device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64)
        try:
            net = llm.engine.runner.model
            assert any(lin.triton for lin in net.prepared_linears()) == (dtype == "auto")
            held.append(net.weight_bytes())
            runs.append([list(o.token_ids) for o in llm.generate(ids, params)])
        finally:
            llm.close()
    assert runs[0] == runs[1]
    assert held[0] < held[1]
