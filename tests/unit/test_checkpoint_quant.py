"""Quantized Hugging Face checkpoints (``engine/checkpoint_quant.py``): a tiny model's weights quantized
here the way the published checkpoints store them (fp8 e4m3 with block, per-channel or per-tensor scales;
gpt-oss's experts in MXFP4), served by ``LLM``, give transformers' greedy tokens on the same dequantized
weights; the loader's weights equal that dequantization bit for bit; bad checkpoints and flags are refused
by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from engine.checkpoint_quant import dequantize_fp8, dequantize_mxfp4
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.hf_loader import iter_hf_weights
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from kernels.gguf_blocks import BlockKind
from kernels.native_ops import native_ops
from tests.families import MIN_MARGIN, build, clear_margin, hf_greedy, prompt
from tests.unit.conftest import save_word_tokenizer

FP8_MAX = 448.0
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS = 8
BLOCKS = {"block": 40, "block32": 32}


def _fp8(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` as (codes, scale, dequantized) in ``scheme``: ``block`` (40 x 40, partial blocks at the
    edges), ``block32`` (32 x 32), ``channel`` or ``tensor``. Written from the formats' definitions, not
    from the loader."""
    if scheme.startswith("block"):
        b = BLOCKS[scheme]
        rows, cols = -(-w.shape[0] // b), -(-w.shape[1] // b)
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[b * i:b * (i + 1), b * j:b * (j + 1)].abs().max()
        scale = amax / FP8_MAX
        full = torch.zeros_like(w)
        for i in range(rows):
            for j in range(cols):
                full[b * i:b * (i + 1), b * j:b * (j + 1)] = scale[i, j]
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand_as(w)
    else:
        scale = w.abs().max() / FP8_MAX
        full = scale.expand_as(w)
    codes = (w / full).to(torch.float8_e4m3fn)
    return codes, scale, codes.to(torch.float32) * full


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` (``[E, in, out]``, input-major as gpt-oss's bf16 checkpoints) as MXFP4 (blocks, scales) over
    ``[E, out, in]`` rows and the dequantized ``[E, in, out]``: each 32 inputs share a power of two chosen
    so their largest magnitude fits under 6, every value rounded to the nearest e2m1 value."""
    rows = w.transpose(1, 2)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, 32)  # [E, out, G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    nearest = (scaled.abs().unsqueeze(-1) - FP4).abs().argmin(-1)  # magnitude codes 0-7
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the low nibble first
    scales = (exponent + 127).to(torch.uint8)
    values = FP4[nearest] * torch.where(scaled < 0, -1.0, 1.0) * torch.pow(2.0, exponent).unsqueeze(-1)
    return blocks, scales, values.reshape(rows.shape).transpose(1, 2).contiguous()


def _save(model: PreTrainedModel, folder: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any]
          ) -> None:
    model.config.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    save_word_tokenizer(folder, model.config.vocab_size)


def fp8_checkpoint(folder: Path, scheme: str) -> PreTrainedModel:
    """A tiny Llama saved with fp8 linears; the returned model holds their dequantized values."""
    model = build("llama")
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not any(f".{p}.weight" in name for p in LINEARS):
                tensors[name] = param.contiguous()
                continue
            codes, scale, deq = _fp8(param, scheme)
            tensors[name] = codes
            tensors[name + ("_scale_inv" if scheme in BLOCKS else "_scale")] = scale.contiguous()
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)  # not read: products in fp32
            param.copy_(deq)
    quant: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme in BLOCKS:
        quant["weight_block_size"] = [BLOCKS[scheme]] * 2
    _save(model, folder, tensors, quant)
    return model


def mxfp4_checkpoint(folder: Path) -> PreTrainedModel:
    """A tiny gpt-oss saved with MXFP4 experts; the returned model holds their dequantized values."""
    model = build("gpt_oss")
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = param.contiguous()
                continue
            blocks, scales, deq = _mxfp4(param)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.contiguous(), scales.contiguous()
            param.copy_(deq)
    _save(model, folder, tensors, {"quant_method": "mxfp4"})
    return model


def _greedy(folder: Path, ids: list[list[int]], **kw: Any) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=64, **kw)
    outs = llm.generate(ids,
                        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _check(model: PreTrainedModel, folder: Path, **kw: Any) -> None:
    ids = [prompt(n, seed=n) for n in (5, 19)]
    ref = [hf_greedy(model, p, STEPS) for p in ids]
    assert min(clear_margin(model, p, r) for p, r in zip(ids, ref, strict=True)) > MIN_MARGIN
    assert _greedy(folder, ids, **kw) == ref


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_fp8_checkpoint_gives_transformers_tokens_on_the_dequantized_weights(tmp_path: Path,
                                                                             scheme: str) -> None:
    model = fp8_checkpoint(tmp_path, scheme)
    loaded = dict(iter_hf_weights(tmp_path))
    expected = model.state_dict()
    assert not any(n.endswith(("_scale", "_scale_inv", "input_scale")) for n in loaded)
    for name in expected:
        if any(f".{p}.weight" in name for p in LINEARS):
            assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], expected[name]), name
    _check(model, tmp_path)
    _check(model, tmp_path, quantization="fp8")


def test_mxfp4_experts_give_transformers_tokens_on_the_dequantized_weights(tmp_path: Path) -> None:
    model = mxfp4_checkpoint(tmp_path)
    loaded = dict(iter_hf_weights(tmp_path))
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(loaded[name], value), name
    assert not any(n.endswith(("_blocks", "_scales")) for n in loaded)
    _check(model, tmp_path, quantization="mxfp4")


def test_a_quantized_checkpoint_is_cut_after_dequantizing_at_tp2(tmp_path: Path) -> None:
    """40 x 40 blocks do not align with TP 2's cuts of 64 rows (32 each) or of 96 (48 each)."""
    model = fp8_checkpoint(tmp_path, "block")
    ids = [prompt(n, seed=n) for n in (5, 19)]
    assert _greedy(tmp_path, ids, tensor_parallel_size=2) == [hf_greedy(model, p, STEPS) for p in ids]


@pytest.mark.skipif(native_ops() is None, reason="the native kernel library cannot be built here")
def test_fp8_codes_are_cut_per_rank_at_tp2(tmp_path: Path) -> None:
    """Under ``--dtype auto`` each rank cuts its rows of QKV and gate/up and its 32 inputs of O from the
    codes (down's 48 inputs split a block: dequantized), and the tokens are transformers' on the
    dequantized weights."""
    model = fp8_checkpoint(tmp_path, "block32")
    ids = [prompt(n, seed=n) for n in (5, 19)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_threads=1, block_size=4, num_kv_blocks=64)
    try:
        layer = llm.engine.runner.model.decoder_layers()[0]
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
        kinds = [lin.kind for lin in (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear)]
        assert kinds == [BlockKind.FP8, BlockKind.FP8, BlockKind.FP8, None]
        outs = llm.generate(ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True))
        assert [list(o.token_ids) for o in outs] == [hf_greedy(model, p, STEPS) for p in ids]
    finally:
        llm.close()


def _logprob_run(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate([prompt(n, seed=n) for n in (5, 19, 40)], params)
    return [(list(o.token_ids), [t.top for t in o.logprobs or [] if t is not None]) for o in outs]


@pytest.mark.skipif(native_ops() is None, reason="the native kernel library cannot be built here")
@pytest.mark.parametrize("scheme", ["block32", "channel", "tensor", "block"])
def test_fp8_codes_are_multiplied_as_read_with_the_dequantized_models_bits(tmp_path: Path,
                                                                           scheme: str) -> None:
    """Under ``--dtype auto`` on CPU the linears keep their fp8 codes (a byte and an eighth a weight) and
    the native product gives bitwise the dequantized float32 model's logprobs, in one native call per step
    and on the per-layer path. 40-wide blocks put two scales in some runs of 32 inputs: those checkpoints
    are dequantized, as before."""
    fp8_checkpoint(tmp_path, scheme)
    kept = LLM(str(tmp_path), num_threads=2)
    floats = LLM(str(tmp_path), dtype="float32", num_threads=2)
    try:
        model, reference = kept.engine.runner.model, floats.engine.runner.model
        layer = model.decoder_layers()[0]
        attn, mlp = layer.attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
        linears = [attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear]
        assert kept.engine.config.dtype == "auto"
        if scheme == "block":
            assert all(lin.kind is None for lin in linears)
        else:
            assert [lin.kind for lin in linears] == [BlockKind.FP8] * 4
            for lin in linears:
                assert lin.packed is not None
                assert lin.packed.numel() == -(-lin.out_features // 16) * 16 * lin.in_features // 32 * 36
            assert model.execution_path == "one native call per step (every layer fused)"
            assert model.weight_bytes() < reference.weight_bytes()
        want = _logprob_run(floats)
        assert _logprob_run(kept) == want  # tokens and top-5 logprobs, bitwise
        model.use_native_decoder = reference.use_native_decoder = False
        assert _logprob_run(kept) == _logprob_run(floats)
        # int8 activations apply to GGUF blocks only: the fp8 codes keep float32 activations
        for lin in linears:
            lin.set_int8_activations(True)
        assert not model.int8_activations
    finally:
        kept.close()
        floats.close()


def test_dequantizers_refuse_shapes_that_do_not_fit() -> None:
    codes = torch.zeros(8, 6).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scales of shape"):
        dequantize_fp8(codes, torch.ones(1, 1), (4, 4), "w")
    with pytest.raises(ValueError, match="neither per tensor nor per output channel"):
        dequantize_fp8(codes, torch.ones(6), None, "w")
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        dequantize_fp8(torch.zeros(8, 6), torch.ones(()), None, "w")
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 3, 1, 16, dtype=torch.uint8), torch.zeros(2, 3, 2, dtype=torch.uint8),
                         "x")


def test_unknown_methods_and_mismatched_flags_are_refused_by_name(tmp_path: Path,
                                                                   default_model_path: Path) -> None:
    fp8_checkpoint(tmp_path, "channel")
    with pytest.raises(ValueError, match="--quantization mxfp4: .* is quantized with fp8"):
        LLMEngine(str(tmp_path), EngineConfig(dtype="float32", quantization="mxfp4", num_kv_blocks=16))
    with pytest.raises(ValueError, match="--quantization must be one of fp8, mxfp4, got 'awq'"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="--quantization fp8: .* is a GGUF file"):
        LLMEngine(str(default_model_path), EngineConfig(quantization="fp8", num_kv_blocks=16))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported; supported: fp8, mxfp4"):
        LLM(model=str(tmp_path), dtype="float32")
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--quantization fp8: .* has no quantization_config"):
        LLMEngine(str(tmp_path), EngineConfig(dtype="float32", quantization="fp8", num_kv_blocks=16))
    file = str(tmp_path / "model.safetensors")
    save_file({k: v for k, v in load_file(file).items() if not k.endswith("_scale")}, file)  # codes alone
    with pytest.raises(ValueError, match="is fp8 but config.json has no quantization_config"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="an fp8 tensor without a weight_scale or weight_scale_inv"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=16)
