"""Experts kept as their codes on CPU (``MoE.block_targets``, ``Prepared.set_blocks(name, matrix, expert)``):
a GGUF's quantized expert stacks, an fp8 checkpoint's expert matrices and gpt-oss's MXFP4 experts (as Q5_0
rows of the same values, ``engine.checkpoint_quant.mxfp4_stack``) are multiplied by the native product as
they are stored, in a fraction of the float32 model's memory, with bitwise the logprobs of the same file
dequantized to float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from engine.checkpoint_quant import dequantize_mxfp4, mxfp4_stack
from engine.layers.moe import MoE
from engine.llm import LLM
from engine.models.causal_lm import CausalLM
from kernels.gguf_blocks import BlockKind
from kernels.native_ops import native_ops
from tests.families import save
from tests.gguf_families import write_gguf
from tests.unit.test_checkpoint_quant import _fp8, _logprob_run, _mxfp4, mxfp4_checkpoint
from tests.unit.test_gguf_blocks import MEMORY

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernel library cannot be built here")


def _moe(llm: LLM, layer: int) -> MoE:
    model: CausalLM = llm.engine.runner.model
    moe = model.decoder_layers()[layer].mlp
    assert isinstance(moe, MoE)
    return moe


def _kinds(moe: MoE) -> tuple[list[BlockKind | None], list[BlockKind | None]]:
    return [lin.kind for lin in moe.w13_linears], [lin.kind for lin in moe.w2_linears]


def _same_as_float32(path: Path, layer: int, w13: BlockKind, w2: BlockKind, shrink: float) -> None:
    """``path`` served under ``--dtype auto`` keeps layer ``layer``'s experts in ``w13`` / ``w2`` (their
    packed records and nothing else) and holds at most ``shrink`` of the float32 model's weight bytes, with
    its logprobs bitwise; restoring the plain stacks gives the float32 model's."""
    kept = LLM(str(path), num_threads=2)
    floats = LLM(str(path), dtype="float32", num_threads=2)
    try:
        mine, theirs = _moe(kept, layer), _moe(floats, layer)
        experts = mine.moe.num_experts
        assert _kinds(mine) == ([w13] * experts, [w2] * experts)
        assert _kinds(theirs) == ([None] * experts, [None] * experts)
        for lin in (*mine.w13_linears, *mine.w2_linears):  # the packed records: bytes per 32 weights
            assert lin.packed is not None and lin.kind is not None
            rows = -(-lin.out_features // 16) * 16
            assert lin.packed.numel() == rows * lin.in_features // 32 * MEMORY[lin.kind]
        held, full = kept.engine.runner.model.weight_bytes(), floats.engine.runner.model.weight_bytes()
        assert held < shrink * full, (held, full)
        assert _logprob_run(kept) == _logprob_run(floats)  # tokens and top-5 logprobs, bitwise
        mine.restore_plain()
        theirs.restore_plain()
        assert torch.equal(mine.w13, theirs.w13) and torch.equal(mine.w2, theirs.w2)
    finally:
        kept.close()
        floats.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gguf_expert_stacks_are_multiplied_in_their_blocks(tmp_path: Path, arch: str) -> None:
    """A Qwen3-MoE or Mixtral GGUF whose experts' gate is Q8_0, up Q4_1 (each expert's fused gate/up: KMIX
    rows) and down Q5_0 (Mixtral's loader renames its experts and passes the blocks through)."""
    save(arch, tmp_path / "hf")
    q = GGMLQuantizationType
    path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", q.Q8_0,
                      types={"ffn_up_exps": q.Q4_1, "ffn_down_exps": q.Q5_0})
    _same_as_float32(path, 1, BlockKind.KMIX, BlockKind.Q5_0, 0.35)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fp8_experts_keep_their_codes(tmp_path: Path, arch: str) -> None:
    """A mixture checkpoint whose attention, MLPs and experts are fp8 with 32 x 32 block scales, as
    DeepSeek-V3 and the Qwen3 fp8 checkpoints ship them; the families that rename tensors (Mixtral's
    ``block_sparse_moe``) or drop some (DeepSeek's prediction layers) pass the codes through. Latent
    attention and shared experts are dequantized."""
    save(arch, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in list(tensors):
        if tensors[name].dim() == 2 and (".experts." in name or name.endswith("_proj.weight")):
            codes, scale, _ = _fp8(tensors[name], "block32")
            tensors[name], tensors[name + "_scale_inv"] = codes, scale.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [32, 32]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _same_as_float32(tmp_path, 1, BlockKind.FP8, BlockKind.FP8, 0.65 if arch == "qwen3_moe" else 0.8)


def test_mxfp4_experts_run_on_q5_0_rows_of_their_values(tmp_path: Path) -> None:
    mxfp4_checkpoint(tmp_path)
    _same_as_float32(tmp_path, 0, BlockKind.Q5_0, BlockKind.Q5_0, 0.75)


def test_mxfp4_stack_holds_the_dequantized_values_or_declines() -> None:
    w = torch.randn(3, 64, 96) * torch.logspace(-6, 2, 96)  # [E, in, out]: groups of very different scales
    blocks, scales, _ = _mxfp4(w)
    stack = mxfp4_stack(blocks, scales, "x")
    assert stack is not None and len(stack.experts) == 3
    want = dequantize_mxfp4(blocks, scales, "x")  # [E, in, out]
    for e, matrix in enumerate(stack.experts):
        assert matrix.kind == BlockKind.Q5_0 and matrix.shape == (96, 64)
        assert torch.equal(matrix.dequantize(), want[e].t())
    scales[1, 5, 0] = 144  # 2**16 is past float16's reach: the caller dequantizes instead
    assert mxfp4_stack(blocks, scales, "x") is None
    scales[1, 5, 0] = 103
    assert mxfp4_stack(blocks, scales, "x") is None
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_stack(blocks, scales[..., :1], "x")
