"""A mixture-of-experts GGUF over two tensor-parallel ranks (real rank processes, gloo over loopback):
greedy tokens equal transformers' on the same weights. gpt-oss as it ships: MXFP4 experts (dequantized
by ``gguf``, each rank's rows cut before), expert and attention biases, attention sinks following the
query heads, alternating sliding windows, YaRN. A dense GGUF's blocks cut per rank and multiplied as
stored. (The float32 file of every family at TP 1: tests/unit/test_gguf_families.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import GptOssForCausalLM

from engine import LLM, SamplingParams
from engine.gguf_loader import iter_gguf_weights
from engine.layers.attention import Attention
from engine.layers.mlp import GatedMLP
from kernels.gguf_blocks import BlockKind
from kernels.native_ops import native_ops
from tests.families import MIN_MARGIN, clear_margin, hf_greedy, prompt, save
from tests.gguf_families import write_gguf

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, num_threads=1, kv_cache_memory=1024**2,
              tp_timeout_s=20.0)


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The GGUF weight and tokenizer caches of this test (the rank processes inherit it)."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    yield


def test_gpt_oss_mxfp4_gguf_at_tp2_equals_transformers(tmp_path: Path) -> None:
    hf = save("gpt_oss", tmp_path / "gpt_oss")
    path = write_gguf(tmp_path / "gpt_oss", tmp_path / "gpt_oss.gguf", GGMLQuantizationType.MXFP4, "_exps")
    # the reference: transformers' model over the very weights the file holds, MXFP4 rounding and all
    reference = GptOssForCausalLM(hf.config).eval()  # type: ignore[arg-type]  # hf is a gpt-oss model
    with torch.no_grad():
        reference.load_state_dict(hf.state_dict())
        _load_experts(reference, dict(iter_gguf_weights(path)))
    hf = reference
    batch = [prompt(5, seed=1), prompt(23, seed=2)]
    expected = [hf_greedy(hf, ids, NEW_TOKENS) for ids in batch]
    for ids, generated in zip(batch, expected, strict=True):
        assert clear_margin(hf, ids, generated) > MIN_MARGIN
    two = LLM(model=str(path), tensor_parallel_size=2, check_integrity=True, **ENGINE)
    try:
        outputs = two.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outputs] == expected
        assert two.engine.model_config.architecture == "gpt_oss"
    finally:
        two.close()


def _load_experts(model: GptOssForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Set transformers' fused experts (``gate_up_proj`` ``[E, hidden, 2I]``, gate and up interleaved;
    ``down_proj`` ``[E, I, hidden]``) from per-expert ``[out, in]`` tensors."""
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(experts.gate_up_proj.shape[0]):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            experts.gate_up_proj.data[e, :, 0::2] = weights[f"{prefix}.gate_proj.weight"].t()
            experts.gate_up_proj.data[e, :, 1::2] = weights[f"{prefix}.up_proj.weight"].t()
            experts.down_proj.data[e] = weights[f"{prefix}.down_proj.weight"].t()


def test_gguf_blocks_are_cut_per_rank_and_multiplied_as_stored_at_tp2(tmp_path: Path) -> None:
    """A wide Llama GGUF (Q8_0, V in Q4_0, down in Q4_K) at TP 2 under ``--dtype auto``: each rank cuts its
    rows (QKV, gate/up: a KMIX QKV of Q8_0 and Q4_0 parts) or its inputs at block boundaries (O's 128,
    down's 256) from the file's blocks and multiplies them as stored, in about a third of the float32
    ranks' memory, with the same tokens and top-5 logprobs, bit for bit, as the file dequantized at TP 2."""
    save("llama_wide", tmp_path / "hf")
    q = GGMLQuantizationType
    path = write_gguf(tmp_path / "hf", tmp_path / "wide.gguf", q.Q8_0,
                      types={"attn_v": q.Q4_0, "ffn_down": q.Q4_K})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    batch = [prompt(9, seed=1), prompt(30, seed=2)]
    runs, held = [], []
    for dtype in ("auto", "float32"):
        llm = LLM(model=str(path), tensor_parallel_size=2, **{**ENGINE, "dtype": dtype})  # type: ignore[arg-type]
        try:
            model = llm.engine.runner.model
            layer = model.decoder_layers()[0]
            attn, mlp = layer.attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, GatedMLP)
            linears = (attn.qkv_linear, attn.o_linear, mlp.gate_up_linear, mlp.down_linear)
            kinds = [lin.kind for lin in linears]
            kept = [BlockKind.KMIX, BlockKind.Q8_0, BlockKind.Q8_0, BlockKind.Q4_K]
            assert kinds == (kept if dtype == "auto" else [None] * 4)
            held.append(model.weight_bytes())
            runs.append([(o.token_ids, [t.top for t in o.logprobs or [] if t is not None])
                         for o in llm.generate(batch, params)])
        finally:
            llm.close()
    assert runs[0] == runs[1] and all(len(tokens) == NEW_TOKENS for tokens, _ in runs[0])
    assert held[0] < held[1] / 2.5


@pytest.mark.skipif(native_ops() is None or not native_ops().int8_available,  # type: ignore[union-attr]
                    reason="no int8 product here (AVX512-VNNI)")
def test_int8_activations_at_tp2_give_the_tp1_tokens(tmp_path: Path) -> None:
    """``--gguf-activations int8`` on the ranks' cut blocks: a row-cut product quantizes the whole input per
    32 inputs, as one rank does, and an input-cut one quantizes its part's runs of 32, the same runs, so
    TP 2 computes TP 1's integer dot products and only adds the ranks' partial sums in another order. The
    file's embedding and head are float32: TP 1 would multiply a quantized head with int8 activations, the
    ranks their dequantized vocabulary rows in float32."""
    save("llama_wide", tmp_path / "hf")
    q = GGMLQuantizationType
    path = write_gguf(tmp_path / "hf", tmp_path / "wide.gguf", q.Q8_0,
                      types={"attn_v": q.Q4_0, "token_embd": q.F32, "output": q.F32})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    batch = [prompt(9, seed=1), prompt(30, seed=2)]
    runs = []
    for size in (1, 2):
        engine: dict[str, Any] = {**ENGINE, "dtype": "auto", "gguf_activations": "int8"}
        llm = LLM(model=str(path), tensor_parallel_size=size, **engine)
        try:
            assert llm.engine.runner.model.int8_activations
            runs.append([(o.token_ids, [t.top[0][1] for t in o.logprobs or [] if t is not None])
                         for o in llm.generate(batch, params)])
        finally:
            llm.close()
    assert [tokens for tokens, _ in runs[0]] == [tokens for tokens, _ in runs[1]]
    for (_, one), (_, two) in zip(runs[0], runs[1], strict=True):
        assert max(abs(a - b) for a, b in zip(one, two, strict=True)) < 1e-3
