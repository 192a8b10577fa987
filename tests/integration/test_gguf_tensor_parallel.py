"""A mixture-of-experts GGUF over two tensor-parallel ranks (real rank processes, gloo over loopback):
greedy tokens equal transformers' on the same weights. gpt-oss as it ships: MXFP4 experts (dequantized
by ``gguf``, each rank's rows cut before), expert and attention biases, attention sinks following the
query heads, alternating sliding windows, YaRN. (The float32 file of every family at TP 1:
tests/unit/test_gguf_families.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import GptOssForCausalLM

from engine import LLM, SamplingParams
from engine.gguf_loader import iter_gguf_weights
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
