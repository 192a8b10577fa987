"""Token sampling: per-request parameters, logits processing and seeded draws.

One step turns a ``[B, V]`` float32 logits tensor (one row per running request)
into one token per row, in this order:

1. penalties (``apply_penalties``): repetition over prompt + output tokens
   (HF/vLLM: divide positive logits, multiply negative ones), then presence and
   frequency over output tokens only (OpenAI: ``logit -= presence * (count > 0)
   + frequency * count``);
2. logprobs, when asked for, are ``log_softmax`` of these penalised logits:
   after penalties, before min_tokens masking, temperature, top-k, top-p and
   min-p (so they describe the model, not the sampling transforms, and never
   hold ``-inf`` for a masked eos);
3. min_tokens: eos ids (unless ``ignore_eos``) and stop ids get ``-inf`` until
   ``min_tokens`` tokens have been generated;
4. greedy rows take the argmax (ties go to the lowest id); other rows apply
   temperature, top-k, top-p (nucleus, at least one token kept) and min-p, then
   draw by inverting the row's cumulative distribution: one float64 uniform ``u``
   in [0, 1) from the request's own ``torch.Generator``, and the first token whose
   float64 running sum of ``p`` exceeds ``u`` times the row's total (``draw``), so
   a seeded request draws the same tokens whatever else shares its batch, and
   whether one engine or a prefill and a decode worker run it. One
   uniform a row, where an exponential race (``argmax(p / q)``, ``q ~ Exp(1)``
   per token) costs a logarithm and a random number per vocabulary entry: 15 ms
   for 16 rows of 49,152 on two Zen 5 cores, against about 1 ms for this draw
   (docs/benchmarks.md, "Sampling a step's rows").

When every row is plain greedy (no penalties, logprobs or active min_tokens)
the whole batch is one argmax.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.sampling_params import MAX_LOGPROBS as MAX_LOGPROBS  # re-exported: one definition
from engine.sampling_params import SamplingParams as SamplingParams


@dataclass(eq=False)
class SamplingState:
    """One request's sampling state, kept by the engine across steps.

    The engine appends each sampled token to ``output_token_ids``. The generator
    is created on first use on the logits' device, seeded from ``params.seed``
    or, when that is None, from the OS random source so unseeded requests differ.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's generator on ``device`` (created and seeded once). Every sampled token takes
        one uniform from it (``draw``), so a seeded request's generator is created past the uniforms of
        the tokens it already has: a request whose first token a prefill worker sampled continues on
        its decode worker with the uniforms it would have drawn had one engine run it all."""
        if self._generator is None or self._generator.device != device:
            seed = self.params.seed
            self._generator = torch.Generator(device=device)
            start = secrets.randbits(63) if seed is None else seed
            self._generator.manual_seed(start & 0xFFFF_FFFF_FFFF_FFFF)
            for _ in range(0 if seed is None else len(self.output_token_ids)):
                uniform(self._generator, device)
        return self._generator

    def speculated(self, draft: Sequence[int]) -> SamplingState:
        """This state as if ``draft`` had been generated too, drawing from the same generator
        (speculative verification, ``engine/rejection.py``); ``self`` itself when ``draft`` is empty."""
        if not draft:
            return self
        view = SamplingState(self.params, self.prompt_token_ids, self.output_token_ids + list(draft),
                             self.eos_token_ids)
        view._generator = self._generator
        return view

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Ids masked while fewer than ``min_tokens`` tokens have been generated."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return tuple(eos) + self.params.stop_token_ids


@dataclass
class TokenLogprobs:
    """The sampled token's logprob and the ``top`` alternatives, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One token per request, and its logprobs where the request asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _token_counts(id_lists: Sequence[Sequence[int]], vocab: int, like: Tensor) -> Tensor:
    """``[len(id_lists), vocab]`` occurrence counts, via one scatter_add over padded ids."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = [list(ids) + [vocab] * (width - len(ids)) for ids in id_lists]
    index = torch.tensor(padded, dtype=torch.long, device=like.device).view(len(id_lists), width)
    counts = torch.zeros(len(id_lists), vocab + 1, dtype=like.dtype, device=like.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=like.dtype))
    return counts[:, :vocab]


def _row_column(values: Sequence[float], like: Tensor) -> Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def apply_penalties(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """Return ``logits`` with each row's penalties applied; the input is not modified.

    Repetition over prompt + output tokens (positive logits divided, negative
    multiplied), then ``logit -= presence * (count > 0) + frequency * count``
    with counts over output tokens only. Returns the input itself when no row
    has a penalty.
    """
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    params = [states[i].params for i in rows]
    sub = logits[rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (
            _token_counts([states[i].prompt_token_ids + states[i].output_token_ids for i in rows], vocab, sub)
            > 0
        )
        penalty = _row_column([p.repetition_penalty for p in params], sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        counts = _token_counts([states[i].output_token_ids for i in rows], vocab, sub)
        presence = _row_column([p.presence_penalty for p in params], sub)
        frequency = _row_column([p.frequency_penalty for p in params], sub)
        sub = sub - (presence * (counts > 0) + frequency * counts)
    out = logits.clone()
    out[rows] = sub
    return out


def _mask_banned(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """Set min_tokens-banned ids (eos, stop ids) to ``-inf``; copies only if needed."""
    banned = [(i, s.banned_token_ids) for i, s in enumerate(states) if s.banned_token_ids]
    if not banned:
        return logits
    out = logits.clone()
    for row, ids in banned:
        out[row, list(ids)] = -math.inf
    return out


def _filter(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, top-k, top-p and min-p for non-greedy rows; dropped ids get ``-inf``.

    top-p keeps each token whose preceding sorted mass is below ``top_p``, so the
    best token (preceding mass 0 < top_p) always survives.
    """
    vocab = logits.shape[1]
    if any(p.temperature != 1.0 for p in params):
        logits = logits / _row_column([p.temperature for p in params], logits)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    need_k = any(k < vocab for k in top_k)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        if need_k:
            position = torch.arange(vocab, device=logits.device).unsqueeze(0)
            k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(position >= k, -math.inf)
        if need_p:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(-1)[:, :-1]], 1)
            top_p = _row_column([p.top_p for p in params], logits)
            drop = (mass_before >= top_p) & (top_p < 1.0)
            sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(1, order, sorted_logits)
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _row_column([p.min_p for p in params], probs)
        logits = logits.masked_fill(probs < threshold, -math.inf)
    return logits


def _logprobs(
    logits: Tensor, states: Sequence[SamplingState], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Sampled-token and top-k logprobs from ``log_softmax(logits)`` for rows that ask."""
    result: list[TokenLogprobs | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return result
    logprobs = logits[rows].float().log_softmax(dim=-1)
    chosen = torch.tensor([token_ids[i] for i in rows], device=logits.device).unsqueeze(1)
    chosen_values = logprobs.gather(1, chosen).squeeze(1).tolist()
    k = min(max(states[i].params.logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        want = states[row].params.logprobs or 0
        top = list(zip(ids[j][:want], values[j][:want], strict=True))
        result[row] = TokenLogprobs(token_ids[row], chosen_values[j], top)
    return result


def plain_greedy(state: SamplingState) -> bool:
    """Greedy with nothing that changes the argmax of the model's logits (penalties, banned ids) and no
    logprobs: the token is ``logits.argmax()``."""
    p = state.params
    return p.greedy and not p.has_penalties and p.logprobs is None and not state.banned_token_ids


def _sampled(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """The filtered rows' draws, row ``i`` of ``logits`` for ``states[i]``."""
    return draw(_filter(logits, [s.params for s in states]).softmax(dim=-1), states)


def draw(probs: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """One token per row of ``probs`` (``[R, V]``), row ``i`` with one float64 uniform in [0, 1) from
    ``states[i]``'s generator (``invert``)."""
    device = probs.device
    return invert(probs, torch.cat([uniform(s.generator(device), device) for s in states]))


def uniform(generator: torch.Generator, device: torch.device) -> Tensor:
    """The one float64 uniform in [0, 1) a sampled token takes from its request's generator."""
    return torch.rand(1, dtype=torch.float64, device=device, generator=generator)


def invert(probs: Tensor, u: Tensor) -> Tensor:
    """Per row of ``probs`` (``[R, V]``, rows summing to about 1) and its ``u`` (``[R]`` float64 in [0, 1)):
    the first id whose float64 running sum exceeds ``u`` times the row's sum. A zero-probability id
    never comes out: its running sum equals its predecessor's, and ``u * total < total`` for every
    float64 ``u < 1``, so a later positive id's sum exceeds it."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = u.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)


class Sampler:
    """Picks one token per row of a logits batch; see the module docstring for the order."""

    def sample(self, logits: Tensor, requests: Sequence[SamplingState]) -> SamplerOutput:
        """Sample ``[B, V]`` logits, row ``i`` for ``requests[i]``."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
        if all(plain_greedy(s) for s in requests):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        penalised = apply_penalties(logits.float(), requests)
        masked = _mask_banned(penalised, requests)
        rows = [i for i, s in enumerate(requests) if not s.params.greedy]
        if len(rows) == len(requests):  # every row sampled: no argmax, no copy of the rows
            token_ids = _sampled(masked, requests)
        else:
            token_ids = masked.argmax(dim=-1)
            if rows:
                token_ids[rows] = _sampled(masked[rows], [requests[i] for i in rows])
        ids = token_ids.tolist()
        return SamplerOutput(ids, _logprobs(penalised, requests, ids))
