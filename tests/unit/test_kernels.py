"""Kernels against plain dense math and transformers' own rope / RMSNorm."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.config import RopeScaling
from kernels import TorchAttentionBackend, get_attention_backend
from kernels.attention import AttentionMetadata
from kernels.norm import rms_norm
from kernels.rope import RotaryEmbedding, apply_rotary
from tests.unit.attention_cases import make_case

HEAD_DIM = 16


def run_step(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    kv_heads: int,
    block_size: int,
    seed: int = 0,
) -> None:
    case = make_case(query_lens, seq_lens, num_heads, kv_heads, HEAD_DIM, block_size, seed)
    meta, kv, q, new_k, new_v, expected, full_k, full_v, tables = case
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    out = backend.forward(q, new_k, new_v, kv, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for table, s_len, fk, fv in zip(tables, seq_lens, full_k, full_v, strict=True):
        positions = torch.arange(s_len)
        blocks = torch.tensor(table)[positions // block_size]
        assert torch.equal(kv[blocks, 0, positions % block_size], fk)
        assert torch.equal(kv[blocks, 1, positions % block_size], fv)


@pytest.mark.parametrize(("num_heads", "kv_heads"), [(6, 2), (4, 1), (4, 4)])
def test_mixed_batch_matches_dense(num_heads: int, kv_heads: int) -> None:
    # decode, prefill chunk mid-sequence, decode, whole prompt; partial last blocks
    run_step([1, 7, 1, 11], [13, 19, 4, 11], num_heads, kv_heads, block_size=4)


def test_pure_decode_matches_dense() -> None:
    run_step([1] * 5, [1, 9, 16, 17, 30], num_heads=6, kv_heads=2, block_size=8, seed=1)


def test_single_prefill_chunks_and_block_size_one() -> None:
    run_step([5], [12], num_heads=3, kv_heads=1, block_size=4, seed=2)
    run_step([3, 1], [3, 6], num_heads=4, kv_heads=2, block_size=1, seed=3)


def test_backend_is_reusable_across_steps() -> None:
    backend = get_attention_backend("cpu")
    kv = torch.zeros(4, 2, 4, 1, HEAD_DIM)
    for step, (q_len, s_len) in enumerate([(3, 3), (1, 4), (1, 5)]):
        backend.prepare(AttentionMetadata.build(4, [q_len], [s_len], [[2, 0]]))
        q = torch.randn(q_len, 2, HEAD_DIM)
        out = backend.forward(q, torch.randn(q_len, 1, HEAD_DIM), torch.randn(q_len, 1, HEAD_DIM), kv, 0.25)
        assert out.shape == (q_len, 2, HEAD_DIM), step
    assert kv[0, :, 1:].abs().sum() == 0


def _hf_rope(params: dict[str, float | int | str], positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=4096, rope_parameters=params
    )
    rotary = LlamaRotaryEmbedding(config)
    x = torch.empty(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling(),
        RopeScaling(rope_type="linear", factor=4.0),
        RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64),
        # gpt-oss's YaRN (no truncation), DeepSeek's (mscale over mscale_all_dim), and plain YaRN
        RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=64, truncate=False),
        RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, beta_fast=32.0,
                    beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0,
                    mscale_all_dim=0.5),
        RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    ],
)
def test_rope_matches_transformers(scaling: RopeScaling) -> None:
    theta = 500000.0
    params: dict[str, float | int | str] = {"rope_type": scaling.rope_type, "rope_theta": theta}
    if scaling.rope_type != "default":
        params["factor"] = scaling.factor
    if scaling.rope_type == "llama3":
        params.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                      original_max_position_embeddings=scaling.original_max_position_embeddings)
    if scaling.rope_type == "yarn":
        params.update(beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, truncate=scaling.truncate,
                      original_max_position_embeddings=scaling.original_max_position_embeddings)
        extra = {"mscale": scaling.mscale, "mscale_all_dim": scaling.mscale_all_dim}
        params.update({k: v for k, v in extra.items() if v is not None})
    positions = torch.tensor([0, 1, 5, 63, 64, 1000, 4000])
    hf_cos, hf_sin = _hf_rope(params, positions)
    rope = RotaryEmbedding(32, theta, scaling)
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert torch.equal(cos[:, 0], hf_cos)
    assert torch.equal(sin[:, 0], hf_sin)

    q = torch.randn(len(positions), 3, 32)
    k = torch.randn(len(positions), 1, 32)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[None],
                                      hf_sin[None])
    assert torch.equal(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1))


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        RotaryEmbedding(32, 10000.0, RopeScaling(rope_type="dynamic"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [48, 576, 4096])
def test_rms_norm_matches_transformers(dtype: torch.dtype, hidden: int) -> None:
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden))
    x = (torch.randn(5, hidden) * 3).to(dtype)
    assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach())
