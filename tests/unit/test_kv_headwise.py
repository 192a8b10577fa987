"""Head-wise eviction (``--kv-eviction headwise``, ``engine/kv_eviction.py``): a block goes by the largest
share of its mass any layer's KV head gives it, so a block one head relies on survives the blocks many
heads spread their attention over, where H2O's sum over heads drops it; each head's budget is the blocks
that carry 90% of its mass."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.request import Request
from tests.unit.conftest import save_word_tokenizer
from tests.unit.test_kv_eviction import FILLER, VOCAB, blank_llama

HEAVY, DECOY, ANSWER = 60, 62, 10
DECOY_HEADS = 7


def decoy_model(folder: Path) -> None:
    """A one-layer Llama of 8 heads of 8 (one KV head each). Head 0 attends almost only to a ``HEAVY`` token
    when one is in view, and the next token is then ``ANSWER``; heads 1-7 attend almost only to ``DECOY``
    tokens and write nothing.

    Hidden dimension 0 is a constant every token has; every query reads it into its head's dimension 3,
    whose rotary frequency is ~3e-5 (positions barely turn it). Head 0's key reads dimension 1 (large in
    the heavy token) there, heads 1-7's keys dimension 6 (large in a decoy). Head 0's V carries dimension
    2 (the heavy token's), O writes it to dimension 4, and the LM head reads 4 as ``ANSWER``. Filler
    tokens have random dimensions 8 and up, which the head reads for every other token.
    """
    heads = DECOY_HEADS + 1
    dim = 64 // heads
    model = blank_llama(heads, dim)
    slow = dim // 2 - 1  # the first dimension of the slowest rotary pair
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[HEAVY, 1] = embed[HEAVY, 2] = 8.0
        embed[DECOY, 6] = 8.0
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight[slow, 0] = attn.k_proj.weight[slow, 1] = 6.0
        for h in range(1, heads):
            attn.q_proj.weight[h * dim + slow, 0] = attn.k_proj.weight[h * dim + slow, 6] = 6.0
        attn.v_proj.weight[0, 2] = 1.0
        attn.o_proj.weight[4, 0] = 40.0
        model.lm_head.weight[ANSWER, 4] = 8.0
    model.save_pretrained(str(folder), safe_serialization=True)
    save_word_tokenizer(folder, VOCAB)


def test_one_heads_heavy_hitter_survives_headwise_where_h2o_drops_it(tmp_path: Path) -> None:
    """Five decoys in the first five blocks, the heavy token at 120 of 400. Seven heads give each decoy
    block 7/5 of a query's attention against the heavy block's 1, so H2O (budget 128: four blocks beside
    the recent 64 tokens) keeps the decoys and loses the answer; head-wise keeps the heavy token's block,
    half or more of head 0's mass, against the decoys' fifths, and answers as the full cache does on
    every token. Both hold the budget after every step and free every block."""
    decoy_model(tmp_path)
    ids = torch.randint(*FILLER, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    for at in (8, 24, 40, 56, 72):
        ids[at] = DECOY
    ids[120] = HEAVY
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    common = dict(num_kv_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    full = LLM(str(tmp_path), **common).generate([ids], params)[0].token_ids  # type: ignore[arg-type]
    assert full == [ANSWER] * 8
    tokens = {}
    for policy in ("h2o", "headwise"):
        engine = LLM(str(tmp_path), kv_eviction=policy, kv_budget=128, **common).engine  # type: ignore[arg-type]
        request = engine.add_request(ids, params)
        held: list[list[int]] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[policy] = out.token_ids
            if request.request_id in engine.kv._owners:
                held.append(engine.kv.blocks_of(request.request_id))
        assert max(len(t) for t in held) <= 128 // 16 + 1
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert ANSWER not in tokens["h2o"]
    assert tokens["headwise"] == full


def test_headwise_keeps_the_block_one_head_singles_out(tiny_model_dir: Path) -> None:
    """Three full blocks before the recent window, one must go. Block 0 holds a third of one layer's KV
    head's mass and nothing of the others'; block 1 a seventh of each other head's; block 2 twice that.
    H2O sums the heads and frees block 0; head-wise frees block 1, whose largest share of any head's mass
    is the least. A head's budget is the fewest blocks that carry 90% of its mass."""
    chosen = {}
    for policy in ("h2o", "headwise"):
        llm = LLM(str(tiny_model_dir), kv_eviction=policy, kv_budget=64, kv_recent=8, num_kv_blocks=32)
        engine = llm.engine
        assert engine.eviction is not None and engine.eviction.policy == policy
        request = Request("r", list(range(1, 70)), SamplingParams(max_tokens=4))
        assert engine.kv.allocate("r", 64)
        request.num_computed_tokens = 64
        table = engine.kv.blocks_of("r")
        mass = engine.eviction.mass
        assert mass.shape[1] == 4  # 2 layers x 2 KV heads
        mass[torch.tensor(table)] = torch.tensor([[1.0, 10, 3, 0], [1, 0, 3, 0], [1, 0, 1, 0], [1, 0, 0, 0]])
        # spread over 4 blocks; all in one; 6 of 7 in two, 90% in three; no mass (one block)
        assert engine.eviction.head_budgets(table, 16).tolist() == [64, 16, 48, 16]
        rows = torch.tensor([[0.0, 3.5, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [4, 4, 4, 4]])
        mass[torch.tensor(table)] = rows  # block 3 lies in the recent window
        assert engine.eviction.fit(engine.kv, request, 16) == 16  # 64 held + 16 > 64: one block goes
        chosen[policy] = [table.index(b) for b in engine.kv.blocks_of("r")]
        if policy == "headwise":
            assert request.metrics.kv_head_budgets == (48, 48, 48, 48)
        engine.kv.free("r")
    assert chosen == {"h2o": [1, 2, 3], "headwise": [0, 2, 3]}
