"""Verification of speculative tokens: which proposed tokens a request keeps, and the token after them.

Input: the logits of one step for the completing requests, request ``i`` owning ``1 + len(drafts[i])``
consecutive rows (its last known token, then each proposed token), in order. Row ``j`` of request
``i`` scores the token after ``drafts[i][:j]``.

The rule, position by position (``j = 0, 1, ...``): sample row ``j`` exactly as a step without
speculation would (``Sampler.sample``, with the request's state extended by ``drafts[i][:j]``, so
penalties, min_tokens masks and logprobs see the tokens before that position); the sampled token
``t`` is emitted; if ``t == drafts[i][j]`` the proposal is accepted and position ``j + 1`` is
verified, otherwise verification of this request stops. After all proposals are accepted the last
row gives one more token. A request thus emits between 1 and ``1 + len(drafts[i])`` tokens.

Why this is exact. The proposals (n-gram lookup, greedy drafts) are deterministic given the
tokens, i.e. a point mass ``q`` on the proposed ``d``. Standard speculative rejection sampling
accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise draws from the
normalised residual ``max(0, p - q)``, which is ``p`` without ``d``, renormalised. Sampling
``t ~ p`` and accepting iff ``t == d`` does exactly that: ``P(accept) = p(d)``, and a rejected
``t`` is distributed as ``p`` given ``t != d``. Greedy rows take the argmax, so the output equals
decoding without speculation. Because every emitted token is drawn once from the request's own
generator, in order, a seeded request draws the same random numbers as without speculation: its
tokens are reproducible and, up to floating-point differences between a multi-token and a
one-token forward, the same as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import Sampler, SamplingState, TokenLogprobs, plain_greedy


@dataclass
class Verified:
    """Per request, the tokens to append (accepted proposals, then one sampled token) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]

    def num_accepted(self, i: int) -> int:
        return len(self.token_ids[i]) - 1


def verify(sampler: Sampler, logits: torch.Tensor, states: Sequence[SamplingState],
           drafts: Sequence[Sequence[int]]) -> Verified:
    """Apply the module's rule to ``logits`` (``[sum(1 + len(d)), vocab]``)."""
    offsets: list[int] = []
    row = 0
    for draft in drafts:
        offsets.append(row)
        row += 1 + len(draft)
    if logits.shape[0] != row:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {row} verification rows")
    tokens: list[list[int]] = [[] for _ in states]
    lps: list[list[TokenLogprobs | None]] = [[] for _ in states]
    if all(plain_greedy(s) for s in states):
        best = logits.argmax(dim=-1).tolist()
        for i, draft in enumerate(drafts):
            for j in range(len(draft) + 1):
                t = best[offsets[i] + j]
                tokens[i].append(t)
                lps[i].append(None)
                if j == len(draft) or t != draft[j]:
                    break
        return Verified(tokens, lps)
    for s in states:
        if not s.params.greedy:
            s.generator(logits.device)  # created before any extended view shares it
    alive = list(range(len(states)))
    j = 0
    while alive:
        rows = torch.tensor([offsets[i] + j for i in alive], device=logits.device)
        views = [states[i].speculated(drafts[i][:j]) for i in alive]
        out = sampler.sample(logits.index_select(0, rows), views)
        still = []
        for i, t, lp in zip(alive, out.token_ids, out.logprobs, strict=True):
            tokens[i].append(t)
            lps[i].append(lp)
            if j < len(drafts[i]) and t == drafts[i][j]:
                still.append(i)
        alive = still
        j += 1
    return Verified(tokens, lps)
