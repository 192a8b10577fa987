"""How many parameters a model (or one tensor-parallel rank of it) holds, and how many a token reads.

Counted from the config and the family's traits, as ``engine/layers/`` allocates them: per layer the
fused QKV and output products with their biases, q/k norms and sinks (or latent attention's
products), two norms (four with sandwich norms), and the dense MLP or the mixture (router, its bias
or correction bias, shared experts, every expert's three products and their biases); then the
embedding, the final norm and an untied LM head. With a ``TpShard`` the counts are one rank's: its
heads, its MLP and experts' columns, ``ceil(vocab / N)`` rows of the embedding and the head; norms,
routers, latent products and row-parallel biases whole.

``active`` is what one token's forward reads: everything but the experts it is not routed to (its
``top_k`` experts of each mixture layer), embedding included. ``kept`` counts the matrices a loader may
keep in quantized records (``CausalLM.takes_blocks``: dense attention's q/k/v/o and the dense MLP's three,
not latent attention's or shared experts'), ``experts`` the routed experts' matrices (no biases); both
are included in ``total``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.models.registry import family
from engine.tensor_parallel import TpShard


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active: int
    kept: int = 0
    experts: int = 0


def parameter_count(config: ModelConfig, shard: TpShard | None = None) -> ParameterCount:
    shard = shard or TpShard(config)
    c, hd, h = config, config.head_dim, config.hidden_size
    kept_attention = 0
    if c.mla is not None:
        attention = _mla_attention(config, shard)
    else:
        q, kv = shard.num_heads * hd, shard.num_kv_heads * hd
        attention = kept_attention = h * (q + 2 * kv) + q * h
        attention += (q + 2 * kv) * c.attention_bias + h * c.o_proj_bias + 2 * hd * c.qk_norm
        attention += shard.num_heads * c.attention_sinks
    norms = (4 if family(c.architecture).sandwich_norms else 2) * h
    dense = 3 * h * shard.intermediate_size
    total = active = c.num_layers * (attention + norms)
    kept, experts = c.num_layers * kept_attention, 0
    for layer in range(c.num_layers):
        if not c.is_moe_layer(layer):
            total, active, kept = total + dense, active + dense, kept + dense
            continue
        moe = c.moe
        assert moe is not None
        inter = shard.expert_intermediate_size
        router = moe.num_experts * h + moe.num_experts * (moe.router_bias + moe.correction_bias)
        router += 3 * h * (moe.shared_intermediate_size // shard.size)  # shared experts: every token's
        expert = 3 * h * inter + (2 * inter + h) * moe.expert_bias
        total += router + moe.num_experts * expert
        active += router + moe.top_k * expert
        experts += moe.num_experts * 3 * h * inter
    vocab = shard.vocab_per_rank * h
    ends = vocab + h + (0 if c.tie_word_embeddings else vocab)
    return ParameterCount(total + ends, active + ends, kept, experts)


def _mla_attention(config: ModelConfig, shard: TpShard) -> int:
    """One rank's latent attention: the query (direct or its LoRA and norm), the latent's product and
    norm (whole on every rank), the up-projection and output of its heads."""
    mla, h, heads = config.mla, config.hidden_size, shard.num_heads
    assert mla is not None
    rank = mla.q_lora_rank
    query = heads * mla.qk_head_dim * (h if rank is None else rank) + (0 if rank is None else rank * h + rank)
    latent = mla.latent_dim * h + mla.kv_lora_rank
    return query + latent + heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank \
        + h * heads * mla.v_head_dim
