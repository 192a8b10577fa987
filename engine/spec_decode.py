"""Speculative decoding in the engine's step: proposals before scheduling, bookkeeping after verifying.

One step with speculation (``LLMEngine.step``):

1. ``propose(running)``: for each running request that is decoding (exactly one token without K/V),
   up to ``k`` proposed tokens (``engine/ngram.py``), where ``k`` is the configured
   ``num_speculative_tokens`` cut so that the request can neither pass ``max_tokens`` nor
   ``max_model_len`` with all of them accepted, and shrunk or paused by the adaptive rule
   (``engine/spec_config.py``).
2. The scheduler gives such a request ``1 + len(draft)`` tokens of the step's budget when the budget
   and the KV pool have room for them; otherwise it drops the proposal (speculation never preempts a
   request, and never starves one of its plain decode token).
3. The model runner feeds the last token and the proposals as one small chunk over the request's
   paged KV and returns logits for every one of them; ``engine/rejection.py`` picks the tokens kept.
4. ``settle(out, verified)``, before the scheduler advances: each chunk's ``num_new_tokens`` loses
   the rejected proposals (their K/V slots were written but are past ``num_computed_tokens``, so
   nothing reads them and the prefix cache never publishes them), and the request's blocks are cut
   back to what its computed tokens need, exactly what a step without speculation would hold.

Counters follow vLLM's (``spec_decode_num_drafts`` and so on, see ``SpecStats``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

from engine.draft import DraftModel
from engine.kv_cache import KVCacheManager
from engine.ngram import propose_ngram
from engine.rejection import Verified
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.spec_config import SpeculativeConfig

FIRST_PAUSE_STEPS = 4


@dataclass
class SpecStats:
    """Totals since start: drafts (verified proposals), proposed tokens, accepted tokens, and accepted
    tokens by position in the draft (index 0: first proposed token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft (accepted proposals plus the token sampled after them)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Adaptive:
    acceptance: float = 1.0
    pause_left: int = 0
    next_pause: int = FIRST_PAUSE_STEPS


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, max_model_len: int,
                 draft: DraftModel | None = None) -> None:
        if (config.method == "draft_model") != (draft is not None):
            raise ValueError("a draft model goes with, and only with, speculative method draft_model")
        self.config = config
        self.kv = kv
        self.draft = draft
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._state: weakref.WeakKeyDictionary[Request, _Adaptive] = weakref.WeakKeyDictionary()

    def budget(self, request: Request) -> int:
        """Most tokens to propose for ``request`` this step (0: do not speculate)."""
        c = self.config
        state = self._state.setdefault(request, _Adaptive())
        if state.pause_left > 0:
            state.pause_left -= 1
            return 0
        k = c.num_speculative_tokens
        if c.min_acceptance > 0:
            k = max(1, math.ceil(k * state.acceptance - 1e-9))
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(request.output_token_ids) - 1)
        return max(0, min(k, self.max_model_len - request.num_tokens - 1))

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposals for the decoding requests of ``running`` (request id -> tokens), from n-gram lookup
        or the draft model (``engine/draft.py``, which also forgets requests no longer running here).
        A request under a grammar gets none: its mask for each proposed position would need the
        grammar advanced through the proposals before them (it decodes one token per step instead)."""
        c = self.config
        wants: list[tuple[Request, int]] = []
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1 or request.guide is not None:
                continue
            k = self.budget(request)
            if k > 0:
                wants.append((request, k))
        if self.draft is not None:
            self.draft.release({r.request_id for r in running})
            return self.draft.propose([(r.request_id, r.all_token_ids, k) for r, k in wants])
        drafts: dict[str, list[int]] = {}
        for request, k in wants:
            draft = propose_ngram(request.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted: free its draft K/V (nothing to do for n-gram)."""
        if self.draft is not None:
            self.draft.forget(request_id)

    def settle(self, out: SchedulerOutput, verified: Verified) -> None:
        """Drop rejected proposals from ``out``'s chunks and their requests' blocks; count them."""
        completing = [item for item in out.scheduled if item.completes]
        for i, item in enumerate(completing):
            proposed = len(item.spec_token_ids)
            if not proposed:
                continue
            accepted = verified.num_accepted(i)
            item.num_new_tokens -= proposed - accepted
            request = item.request
            self.kv.shrink(request.request_id, request.kv_tokens + item.num_new_tokens)
            self._count(request, proposed, accepted)

    def _count(self, request: Request, proposed: int, accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_pos[pos] += 1
        request.metrics.spec_draft_tokens += proposed
        request.metrics.spec_accepted_tokens += accepted
        c = self.config
        if c.min_acceptance <= 0:
            return
        state = self._state.setdefault(request, _Adaptive())
        rate = accepted / proposed
        state.acceptance = c.acceptance_decay * state.acceptance + (1 - c.acceptance_decay) * rate
        if state.acceptance < c.min_acceptance:
            state.pause_left = state.next_pause
            state.next_pause = min(2 * state.next_pause, c.max_pause_steps)
            state.acceptance = c.min_acceptance  # probe again after the pause, with few tokens
        elif rate >= 0.5:
            state.next_pause = FIRST_PAUSE_STEPS
