"""Heavy-hitter KV eviction (``--kv-eviction h2o``): keep the blocks attention used most, drop the rest.

H2O (Zhang et al., 2023) keeps, per sequence, the tokens with the largest accumulated attention plus a
recent window, and evicts the others once the sequence passes its budget. pdserve's cache is paged
and one block table serves every layer, so it evicts whole blocks:

- **Scores.** The attention backend, given a float32 ``[num_blocks]`` tensor (``mass``), adds to each
  block the attention probability its keys received in every step: summed over layers, KV heads, the
  query heads of each group and the step's queries (the native CPU kernels, ``kernels/cpu_native.py``
  and ``cpu_attention_mass.c``; elsewhere the torch kernel, ``kernels/torch_ref.py``). A block written
  from its first row starts again from zero. Prompt chunks score the earlier chunks, decodes score
  everything they read.
- **Eviction.** Before a sequence's next chunk is scheduled, while its held tokens plus the chunk
  exceed ``budget``, the full block of least mass outside the last ``recent`` held tokens is freed
  (``KVCacheManager.drop_block``) and ``request.kv_dropped_tokens`` grows by a block. The chunk is then
  cut to what the budget leaves, so a sequence never holds more than ``budget`` tokens (rounded up to
  whole blocks) after any step. Positions stay the tokens' own (K is stored after rotary); the kernels
  read the kept blocks in table order with ``seq_len`` the kept count, as ``--kv-window`` does.
- **Prefix cache.** A sequence that has dropped a block publishes nothing more (its KV no longer equals
  a fresh prefill's), as with ``--kv-window``.

Why whole blocks and not tokens: a per-token map the kernels read would change every attention kernel
and the transfer's unit; compacting survivors into fewer blocks rewrites KV every step. A block's mass
is a sum of its tokens', so a block holding one heavy hitter survives with it, at the cost of keeping
its 15 neighbours; the measured quality is in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request

EVICTION_POLICIES = ("none", "h2o")


@dataclass
class KvEviction:
    """A sequence's KV budget in tokens, the recent tokens it always keeps, and the blocks' attention
    mass (float32 ``[num_blocks]``, written by the attention backend). ``evicted_tokens`` counts every
    token freed since start."""

    budget: int
    recent: int
    mass: torch.Tensor
    evicted_tokens: int = 0

    @staticmethod
    def for_engine(config: EngineConfig, model: ModelConfig, mass: torch.Tensor | None) -> KvEviction | None:
        """``--kv-eviction h2o``'s state over the runner's ``mass`` (None when eviction is off); ValueError
        for a model or set-up whose attention cannot be scored."""
        if config.kv_eviction == "none":
            return None
        for why, refused in ((f"{model.name}'s sliding-window layers", model.has_sliding_layers),
                             ("latent attention (MLA)", model.mla is not None),
                             ("--tensor-parallel-size > 1", config.tensor_parallel_size > 1)):
            if refused:
                raise ValueError(f"--kv-eviction h2o does not support {why}")
        assert mass is not None
        return KvEviction(config.kv_budget or 0, config.kv_recent_tokens, mass)

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
            scores = self.mass[torch.tensor(table[:candidates], dtype=torch.int64)]
            victim = int(torch.argmin(scores))
            kv.drop_block(request.request_id, victim)
            request.kv_dropped_tokens += bs
            request.metrics.kv_evicted_tokens += bs
            self.evicted_tokens += bs
        return max(1, min(n, self.budget - request.kv_tokens))
