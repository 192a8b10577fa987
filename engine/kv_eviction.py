"""Attention-aware KV eviction (``--kv-eviction h2o|headwise``): keep the blocks attention uses, drop the
rest.

H2O (Zhang et al., 2023) keeps, per sequence, the tokens with the largest accumulated attention plus a
recent window, and evicts the others once the sequence passes its budget. Head-wise budgets (arXiv
2511.00868) start from heads differing in how concentrated their attention is: a head that looks at a few
places needs those kept, a head that spreads its attention loses a share of it whatever goes. pdserve's
cache is paged and one block table serves every layer and head, so both evict whole blocks:

- **Scores.** The attention backend, given a float32 ``[num_blocks, layers x kv_heads]`` tensor (``mass``),
  adds to each block, in the column of each layer's KV head, the attention probability its keys received
  in every step: summed over that KV head's query heads and the step's queries (the native CPU kernels,
  ``kernels/cpu_native.py`` and ``cpu_attention_mass.c``; elsewhere the torch kernel,
  ``kernels/torch_ref.py``). A block written from its first row starts again from zero. Prompt chunks
  score the earlier chunks, decodes score everything they read.
- **Which block goes.** ``h2o``: the candidate whose mass summed over every layer and KV head is least.
  ``headwise``: each layer's KV head ``j`` has a share ``p_j(b)`` of its mass over the sequence's held
  blocks in block ``b``; the candidate whose largest share, ``max_j p_j(b)``, is least goes. A block one
  concentrated head relies on (a retrieval head's fact, a sink) stays even when the other heads, whose
  mass is spread, give it little; a block no head singles out goes first. So each head gets the blocks it
  concentrates on, measured online: its budget, ``head_budgets``, is the fewest held blocks that carry
  ``COVERAGE`` of its mass (a spread head's is large, a concentrated head's small), reported per request
  (``RequestMetrics.kv_head_budgets``; the decode span's ``pdserve.kv.head_budget_min`` / ``_max``,
  ``/metrics``' ``pdserve:kv_head_budget_tokens``).
- **Eviction.** Before a sequence's next chunk is scheduled, while its held tokens plus the chunk
  exceed ``budget``, the full block chosen above among those outside the last ``recent`` held tokens is
  freed (``KVCacheManager.drop_block``) and ``request.kv_dropped_tokens`` grows by a block. The chunk is
  then cut to what the budget leaves, so a sequence never holds more than ``budget`` tokens (rounded up to
  whole blocks) after any step. Positions stay the tokens' own (K is stored after rotary); the kernels
  read the kept blocks in table order with ``seq_len`` the kept count, as ``--kv-window`` does.
- **Prefix cache.** A sequence that has dropped a block publishes nothing more (its KV no longer equals
  a fresh prefill's), as with ``--kv-window``.

Why whole blocks and not tokens: a per-token map the kernels read would change every attention kernel
and the transfer's unit; compacting survivors into fewer blocks rewrites KV every step. A block's mass
is a sum of its tokens', so a block holding one heavy hitter survives with it, at the cost of keeping
its 15 neighbours; the measured quality is in docs/benchmarks.md. Why every head reads every kept block
(and not only the blocks of its own budget): the blocks hold every head's K and V, so a block some head
keeps is held for all; a head reading fewer of them would free no memory and only lose attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request

COVERAGE = 0.9  # a head's budget: the fewest held blocks that carry this share of its mass


@dataclass
class KvEviction:
    """The policy (``h2o`` or ``headwise``), a sequence's KV budget in tokens, the recent tokens it always
    keeps, and the blocks' attention mass (float32 ``[num_blocks, layers x kv_heads]``, written by the
    attention backend). ``evicted_tokens`` counts every token freed since start."""

    policy: str
    budget: int
    recent: int
    mass: torch.Tensor
    evicted_tokens: int = 0

    @staticmethod
    def for_engine(config: EngineConfig, model: ModelConfig, mass: torch.Tensor | None) -> KvEviction | None:
        """``--kv-eviction``'s state over the runner's ``mass`` (None when eviction is off); ValueError for a
        model or set-up whose attention cannot be scored."""
        if config.kv_eviction == "none":
            return None
        for why, refused in ((f"{model.name}'s sliding-window layers", model.has_sliding_layers),
                             ("latent attention (MLA)", model.mla is not None),
                             ("--tensor-parallel-size > 1", config.tensor_parallel_size > 1)):
            if refused:
                raise ValueError(f"--kv-eviction {config.kv_eviction} does not support {why}")
        assert mass is not None
        return KvEviction(config.kv_eviction, config.kv_budget or 0, config.kv_recent_tokens, mass)

    def scores(self, table: list[int], candidates: int) -> torch.Tensor:
        """The first ``candidates`` blocks of ``table`` (a sequence's held blocks), scored so the least
        goes first: the summed mass (``h2o``) or the largest share any layer's KV head gives the block of
        its mass over ``table`` (``headwise``)."""
        rows = self.mass[torch.tensor(table, dtype=torch.int64, device=self.mass.device)]
        if self.policy == "h2o":
            return rows[:candidates].sum(dim=1)
        totals = rows.sum(dim=0).clamp_min(torch.finfo(torch.float32).tiny)
        return (rows[:candidates] / totals).amax(dim=1)

    def head_budgets(self, table: list[int], block_size: int) -> torch.Tensor:
        """Each layer's KV head's budget in tokens (int64 ``[layers x kv_heads]``): the fewest of ``table``'s
        blocks that carry ``COVERAGE`` of its mass over them, times the block size."""
        rows = self.mass[torch.tensor(table, dtype=torch.int64, device=self.mass.device)]
        ordered = rows.sort(dim=0, descending=True).values.cumsum(dim=0)  # [blocks, heads]
        needed = (ordered < COVERAGE * ordered[-1:]).sum(dim=0) + 1
        return needed.clamp(max=len(table)).cpu() * block_size

    def fit(self, kv: KVCacheManager, request: Request, n: int) -> int:
        """Free ``request``'s lowest-mass blocks until its held tokens plus ``n`` fit the budget (or no
        block outside the recent window is left); returns ``n`` cut to what the budget leaves (at least
        1: a sequence whose recent window alone fills the budget still advances)."""
        bs = kv.block_size
        while request.kv_tokens + n > self.budget:
            candidates = max(0, (request.kv_tokens - self.recent) // bs)  # full blocks before the window
            if candidates == 0:
                break
            table = kv.blocks_of(request.request_id)
            if self.policy == "headwise":
                budgets = self.head_budgets(table, bs)
                request.metrics.kv_head_budgets = tuple(budgets.tolist())
            victim = int(torch.argmin(self.scores(table, candidates)))
            kv.drop_block(request.request_id, victim)
            request.kv_dropped_tokens += bs
            request.metrics.kv_evicted_tokens += bs
            self.evicted_tokens += bs
        return max(1, min(n, self.budget - request.kv_tokens))
