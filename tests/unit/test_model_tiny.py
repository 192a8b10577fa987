"""Tiny random Llama-family models: our paged CausalLM against transformers, fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.config import ModelConfig, RopeScaling
from engine.kv_tensors import allocate_kv_cache, allocate_kv_scales
from engine.layers.attention import Attention
from engine.layers.decoder import DecoderLayer
from engine.layers.mlp import GatedMLP
from engine.models.causal_lm import CausalLM
from kernels import AttentionBackend, get_attention_backend
from kernels.attention import AttentionMetadata
from kernels.kv_quant import is_quantized
from kernels.mla import MlaTorchBackend
from kernels.native_ops import native_ops

if TYPE_CHECKING:
    from engine.compiled import CompiledDecoder

BLOCK_SIZE = 4
NUM_BLOCKS = 40
VOCAB = 256
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
HFModel = LlamaForCausalLM | Qwen2ForCausalLM
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def hf_model(variant: str) -> HFModel:
    """A seeded random model; norms and biases are perturbed too (transformers inits them to 1 and 0)."""
    torch.manual_seed(0)
    model = _build(variant)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def _build(variant: str) -> HFModel:
    if variant == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **COMMON)).eval()
    config = {
        "llama3": LlamaConfig(
            num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=LLAMA3_ROPE, **COMMON
        ),
        "tied": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON),
        "mqa": LlamaConfig(num_key_value_heads=1, **COMMON),
        # heads of 32 (a multiple of every build's blocked-attention step: prompt chunks take that kernel)
        "wide-heads": LlamaConfig(num_key_value_heads=1, **{**COMMON, "num_attention_heads": 2}),
    }[variant]
    return LlamaForCausalLM(config).eval()


def model_config(hf: PretrainedConfig) -> ModelConfig:
    rope = dict(hf.rope_parameters or {})
    return ModelConfig(
        architecture=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        rope_scaling=RopeScaling(
            rope_type=rope.get("rope_type", "default"),
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        ),
    )


class PagedRunner:
    """Runs steps of (sequence id, new tokens) over a paged cache with shuffled block ids."""

    def __init__(self, hf: HFModel | None, model: CausalLM | None = None,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        if model is None:
            assert hf is not None
            model = CausalLM(model_config(hf.config), torch.float32)
            model.load_weights(hf.state_dict().items())
        self.model = model
        self.kv = allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, kv_dtype, "cpu")
        # a quantized cache's scales (kernels/kv_quant.py, kernels/kv_int4.py)
        self.kv_scales = (allocate_kv_scales(model.config, NUM_BLOCKS, "cpu", dtype=kv_dtype)
                          if is_quantized(kv_dtype) else None)
        mla = model.config.mla is not None
        self.backend: AttentionBackend = (cast(AttentionBackend, MlaTorchBackend()) if mla
                                          else get_attention_backend("cpu"))
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.compiled: CompiledDecoder | None = None  # decode steps through engine/compiled.py when set

    @classmethod
    def over(cls, model: CausalLM) -> PagedRunner:
        """A runner over a model already loaded."""
        return cls(None, model)

    @torch.inference_mode()
    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Logits ``[len(tokens), vocab]`` for each entry of ``work``."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq, tokens in work:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, start + len(tokens))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(list(table))
            self.lens[seq] = start + len(tokens)
        meta = AttentionMetadata.build(BLOCK_SIZE, query_lens, seq_lens, tables)
        self.backend.prepare(meta)
        if self.compiled is not None and self.compiled.handles(meta):
            hidden = self.compiled.forward(torch.tensor(ids), torch.tensor(positions), self.kv, self.backend)
        else:
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv, self.backend, meta,
                                self.kv_scales)
        return list(self.model.compute_logits(hidden).split(query_lens))


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=gen).tolist()


@torch.inference_mode()
def hf_greedy(hf: HFModel, tokens: list[int], steps: int) -> list[int]:
    # transformers types generate() for its own protocol class, which these models do not name
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=steps, do_sample=False)  # type: ignore[misc]
    return out[0, len(tokens):].tolist()


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "tied", "mqa"])
def test_chunked_prefill_and_greedy_decode_match_transformers(variant: str) -> None:
    hf = hf_model(variant)
    runner = PagedRunner(hf)
    tokens = prompt(40, seed=2)
    logits = torch.cat([runner.step([(0, tokens[i : i + 16])])[0] for i in range(0, 40, 16)])
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    generated = [int(logits[-1].argmax())]
    decode_logits = []
    for _ in range(9):
        decode_logits.append(runner.step([(0, generated[-1:])])[0][-1])
        generated.append(int(decode_logits[-1].argmax()))
    assert generated == hf_greedy(hf, tokens, 10)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens + generated[:-1]])).logits[0, 40:]
    torch.testing.assert_close(torch.stack(decode_logits), expected, atol=1e-4, rtol=1e-4)


def test_mixed_batches_match_transformers_per_sequence() -> None:
    hf = hf_model("llama3")
    runner = PagedRunner(hf)
    a, b = prompt(40, seed=3), prompt(23, seed=4)
    runner.step([(0, a[:16]), (1, b[:10])])
    _, logits_b = runner.step([(0, a[16:32]), (1, b[10:])])
    out_b = [int(logits_b[-1].argmax())]
    logits_b, logits_a = runner.step([(1, out_b[-1:]), (0, a[32:])])
    out_b.append(int(logits_b[-1].argmax()))
    out_a = [int(logits_a[-1].argmax())]
    for _ in range(8):
        logits_a, logits_b = runner.step([(0, out_a[-1:]), (1, out_b[-1:])])
        out_a.append(int(logits_a[-1].argmax()))
        out_b.append(int(logits_b[-1].argmax()))
    assert out_a == hf_greedy(hf, a, 9)
    assert out_b == hf_greedy(hf, b, 10)


def test_load_weights_names_the_bad_parameter() -> None:
    hf = hf_model("tied")
    model = CausalLM(model_config(hf.config), torch.float32)
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing parameters: model\.layers\.1\.mlp\.up_proj\.weight"):
        model.load_weights(state.items())
    with pytest.raises(ValueError, match=r"unexpected parameter 'model\.layers\.9\.foo'"):
        model.load_weights([("model.layers.9.foo", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.skipif(native_ops() is None, reason="native CPU kernels cannot be built here")
def test_fused_native_ops_match_the_torch_ops() -> None:
    hf = hf_model("llama3")
    fused, unfused = PagedRunner(hf), PagedRunner(hf)
    unfused.model.use_native_ops = False
    tokens = prompt(21, seed=5)
    for work in ([(0, tokens), (1, tokens[:7])], [(0, [3]), (1, [9])], [(0, [4])]):  # prefill, x2, x1
        for got, want in zip(fused.step(work), unfused.step(work), strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(native_ops() is None, reason="native CPU kernels cannot be built here")
def test_native_products_keep_one_copy_of_each_matrix() -> None:
    """The native kernel reads packed copies only, so the [out, in] matrices are freed after loading;
    they come back bitwise for another kernel, and a second load works."""
    hf = hf_model("qwen2")
    state = hf.state_dict()
    runner = PagedRunner(hf)
    model = runner.model
    layer = model.layers[1]
    assert isinstance(layer, DecoderLayer) and layer.plain_released
    assert isinstance(layer.attn, Attention) and isinstance(layer.mlp, GatedMLP)
    for matrix in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj):
        assert matrix.untyped_storage().nbytes() == 4 and matrix.dim() == 2
    tokens = prompt(21, seed=6)
    first = runner.step([(0, tokens)])[0]

    model.prepare_linears("prepacked")
    prefix = "model.layers.1."
    assert not layer.plain_released
    qkv = [state[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(layer.attn.qkv, torch.cat(qkv))
    gate_up = [state[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(layer.mlp.gate_up, torch.cat(gate_up))
    assert torch.equal(layer.mlp.down_proj, state[prefix + "mlp.down_proj.weight"])

    model.prepare_linears("native")
    model.load_weights(state.items())  # into the restored matrices, then packed and freed again
    assert layer.plain_released
    runner.tables, runner.lens = {}, {}  # the same sequence again, from scratch, over the reloaded model
    runner.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(runner.step([(0, tokens)])[0], first)
