"""Tiny random models of every registered family, built and saved by transformers (config, safetensors
and a word-level tokenizer), for the parity tests against transformers.

Greedy picks near a tie would flip on rounding: weights are drawn with ``initializer_range`` 0.2, every
1-D parameter (norms, biases, sinks; transformers initialises them to 1 or 0) is perturbed by N(0, 0.2),
the LM head is scaled by ``HEAD_SCALE`` (logits spread wider, so the top two stand further apart), and
``clear_margin`` checks each pick of the reference beats its runner-up by at least ``MIN_MARGIN`` (50 times
the float32 differences seen between the two implementations), so a token that differs means a wrong
computation, not a rounding flip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.unit.conftest import save_word_tokenizer

VOCAB = 255  # not a multiple of 2: the last vocabulary shard of TP 2 is padded
WINDOW = 7  # sliding windows smaller than the prompts and not a multiple of any block size
MIN_MARGIN = 5e-4
HEAD_SCALE = 4.0
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None, tie_word_embeddings=False,
)


def _qwen3() -> PreTrainedModel:
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **COMMON))


def _qwen3_moe() -> PreTrainedModel:
    # a dense first layer (mlp_only_layers), renormalised top-2 of 4 experts
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32, norm_topk_prob=True,
                                              mlp_only_layers=[0], **COMMON))


def _mixtral() -> PreTrainedModel:
    return MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                            **COMMON))


def _gemma3() -> PreTrainedModel:
    kinds = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = Gemma3TextConfig(num_hidden_layers=4, layer_types=kinds, sliding_window=WINDOW,
                              query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 100000.0},
                                               "sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 1000.0}},
                              **{**COMMON, "tie_word_embeddings": True})
    return Gemma3ForCausalLM(config)


def _gpt_oss() -> PreTrainedModel:
    config = GptOssConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 16},
                          **{**COMMON, "intermediate_size": 32})
    return GptOssForCausalLM(config)


MLA: dict[str, Any] = dict(  # transformers' DeepSeek expands the latent to every head: KV heads = heads
    moe_intermediate_size=32, num_hidden_layers=3, num_experts_per_tok=2, first_k_dense_replace=1,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
    **{**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4},
)


def _deepseek_v2() -> PreTrainedModel:
    # no query LoRA, a dense first layer, softmax top-2 of 4 experts and a shared expert
    return DeepseekV2ForCausalLM(DeepseekV2Config(n_routed_experts=4, q_lora_rank=None, **MLA))


def _deepseek_v3() -> PreTrainedModel:
    # a query LoRA, sigmoid top-2 of 8 experts chosen from the best 2 of 4 groups, a shared expert
    # (``scoring_func`` as DeepSeek-V3's published config states it: transformers' V3 is sigmoid whatever it
    # says, llama.cpp's converter writes it as the gating function)
    published: dict[str, Any] = {"scoring_func": "sigmoid"}
    return DeepseekV3ForCausalLM(DeepseekV3Config(n_routed_experts=8, n_group=4, topk_group=2, q_lora_rank=24,
                                                  **published, **MLA))


def _llama() -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **{k: v for k, v in COMMON.items()}))


def _llama_wide() -> PreTrainedModel:
    """The Llama with every matrix's input width a multiple of 256 (llama.cpp's K formats need it)."""
    wide = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **wide))


BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": _llama, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "gemma3": _gemma3,
    "gpt_oss": _gpt_oss, "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3,
}
OTHERS: dict[str, Callable[[], PreTrainedModel]] = {"llama_wide": _llama_wide}  # not a family of its own
NEW_FAMILIES = ("qwen3", "qwen3_moe", "mixtral", "gemma3", "gpt_oss", "deepseek_v2", "deepseek_v3")


def build(family: str, seed: int = 0) -> PreTrainedModel:
    """The family's tiny random model (float32, eval, eager attention), weights as the module says."""
    torch.manual_seed(seed)
    model = {**BUILDERS, **OTHERS}[family]()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's router correction bias (zeros)
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model.eval()


def save(family: str, folder: Path, seed: int = 0) -> PreTrainedModel:
    """``build`` saved into ``folder`` with a word-level tokenizer over ``VOCAB`` words."""
    model = build(family, seed)
    model.save_pretrained(str(folder), safe_serialization=True)
    save_word_tokenizer(folder, VOCAB)
    return model


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (length,), generator=gen).tolist()


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    """transformers' own greedy continuation of ``ids``."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=steps,  # type: ignore[operator]
                         do_sample=False)
    return list(out[0, len(ids):].tolist())


@torch.inference_mode()
def clear_margin(model: PreTrainedModel, ids: list[int], generated: list[int]) -> float:
    """The smallest gap between transformers' top two logits where it picked ``generated`` after ``ids``."""
    logits = model(torch.tensor([ids + generated[:-1]])).logits[0, len(ids) - 1 :]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def agree_up_to_a_near_tie(tokens: Sequence[int], reference: Sequence[int],
                           tops: Iterable[Sequence[tuple[int, float]]], margin: float) -> int:
    """Greedy ``tokens`` of a prompt under one arithmetic against the ``reference``'s under another, whose
    top two logprobs per step are ``tops``: equal up to their first difference, which must come at a near
    tie (a gap under ``margin``, which either arithmetic may flip; the contexts differ after it). Returns
    how many clear picks agreed."""
    clear = 0
    for step, top in enumerate(tops):
        near_tie = top[0][1] - top[1][1] < margin
        if tokens[step] != reference[step]:
            if not near_tie:
                raise AssertionError(f"step {step}: {tokens[step]} against {reference[step]}, whose margin "
                                     f"is clear ({top})")
            return clear
        clear += not near_tie
    return clear
