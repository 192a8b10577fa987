"""Grammar-constrained decoding: compiled grammars (cached), per-request guides, logit masks.

Contracts:

* ``Grammars.compile(so)`` returns the pristine matcher of ``so``'s grammar,
  compiled once and cached under ``so.key`` (LRU, ``cache_size`` entries);
  ``prepare(so)`` does the same in the engine's grammar thread and returns a
  future, so a worker awaits a slow grammar without holding the engine lock and
  other requests keep stepping. A bad grammar raises ``GrammarError``.
* ``Grammars.guide(so, replay)`` is a request's own matcher (a copy of the cached
  one) advanced over ``replay``, the tokens already generated under the grammar
  (a migrated request's resumed tokens); tokens the grammar refuses raise
  ``GrammarError``. A guide's state is a pure function of the tokens it accepted,
  so a decode worker rebuilds the prefill worker's state by accepting the first
  token, and a continuation by replaying what was streamed.
* ``Guide.accept(token)`` advances the state (``False``: the grammar refuses the
  token); ``Guide.rollback(n)`` forgets the last ``n`` accepted tokens (at most
  ``MAX_ROLLBACK``), for whoever discards tokens after sampling them.
* ``Grammars.apply(logits, guides)`` sets to ``-inf`` the logit of every token the
  grammar does not allow next, for each row whose guide is not None, in place.
  A guide whose grammar is complete allows only end-of-sequence.

The llguidance tokenizer is converted once per engine, on the first constrained
request (about half a second for a 49k vocabulary), in the grammar thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.grammar import GrammarError, check
from engine.sampling_params import SamplingParams, StructuredOutput
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where a grammar is first compiled: an engine serving none never loads it
    import llguidance

MAX_ROLLBACK = 64


@dataclass
class StructuredStats:
    """Counters of one engine's constrained decoding (cumulative)."""

    constrained_requests: int = 0
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0
    mask_steps: int = 0
    mask_rows: int = 0
    mask_seconds: float = 0.0


_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # bit 0 -> -inf, bit 1 -> 0


def _bits(mask: torch.Tensor | np.ndarray, vocab: int) -> np.ndarray:
    """``[k, words]`` int32 (bit ``t % 32`` of word ``t // 32`` set: token ``t`` allowed) -> ``[k, vocab]``
    uint8 0/1; ids past the mask's width are 0. The words are little-endian, so the bits in byte order,
    least significant first, are the tokens in order."""
    words = mask.numpy() if isinstance(mask, torch.Tensor) else mask
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits[:, :vocab]


def unpack_bitmask(mask: torch.Tensor | np.ndarray, vocab: int) -> torch.Tensor:
    """The allowed tokens of a bitmask as ``[k, vocab]`` bool."""
    return torch.from_numpy(np.ascontiguousarray(_bits(mask, vocab)).view(np.bool_))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added (ids past the vocabulary are ignored); the input
    itself when no row has one, else a copy."""
    if not any(p.logit_bias for p in params):
        return logits
    vocab = logits.shape[1]
    logits = logits.clone()
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias if t < vocab]
            bias = [b for t, b in p.logit_bias if t < vocab]
            logits[row, ids] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    return logits


class Guide:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        ok = bool(self.matcher.consume_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def rollback(self, n: int) -> None:
        if not 0 <= n <= min(self.num_accepted, MAX_ROLLBACK):
            raise ValueError(f"cannot roll back {n} tokens (accepted {self.num_accepted}, "
                             f"at most {MAX_ROLLBACK})")
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")
        self.num_accepted -= n

    @property
    def stopped(self) -> bool:
        """The grammar is complete and ended (end-of-sequence accepted, or nothing more can follow)."""
        return bool(self.matcher.is_stopped())

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (tests and checks; the engine uses masks)."""
        return bool(self.matcher.validate_tokens([token_id]) == 1)


class Grammars:
    """Compiled grammars for one tokenizer and one vocabulary size (the model's logits width)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.stats = StructuredStats()
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance
        import llguidance.hf

        from engine.token_bytes import TokenBytes

        with self._lock:
            if self._lltok is None:
                try:
                    self._lltok = llguidance.hf.from_tokenizer(self.tokenizer.hf,  # type: ignore[arg-type]
                                                               n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
                except ValueError:  # a tokenizer llguidance cannot read itself (e.g. no decoder)
                    self._lltok = llguidance.LLTokenizer(TokenBytes(self.tokenizer, self.vocab_size,
                                                                    self.eos_token_ids))
            return self._lltok

    def cached(self, so: StructuredOutput) -> bool:
        with self._lock:
            return so.key in self._cache

    def compile(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine matcher of ``so`` (cached); raises GrammarError."""
        with self._lock:
            hit = self._cache.get(so.key)
            if hit is not None:
                self._cache.move_to_end(so.key)
                self.stats.cache_hits += 1
                return hit
        import llguidance

        started = time.perf_counter()
        grammar = check(so)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        matcher.compute_bitmask()  # builds the lexer's first states now, not in a step
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - started
            self._cache[so.key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def prepare(self, so: StructuredOutput) -> Future[llguidance.LLMatcher]:
        """``compile(so)`` in the grammar thread (a finished future when cached)."""
        if self.cached(so):
            done: Future[llguidance.LLMatcher] = Future()
            done.set_result(self.compile(so))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.compile, so)

    def guide(self, so: StructuredOutput, replay: Sequence[int] = ()) -> Guide:
        """A request's guide, advanced over ``replay``; raises GrammarError."""
        guide = Guide(self.compile(so).deep_copy())
        for token in replay:
            if not guide.accept(token):
                raise GrammarError(f"resumed token {token} does not follow the grammar")
        self.stats.constrained_requests += 1
        return guide

    def apply(self, logits: torch.Tensor, guides: Sequence[Guide | None]) -> torch.Tensor:
        """``logits`` (``[len(guides), V]``) with ``-inf`` wherever a row's guide disallows the token (the
        input itself when no row has a guide, else a new tensor)."""
        rows = [i for i, g in enumerate(guides) if g is not None]
        if not rows:
            return logits
        started = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        mask = np.empty((len(rows), words), dtype=np.int32)
        for j, i in enumerate(rows):  # microseconds each: cheaper than handing them to a thread pool
            guides[i].matcher.unsafe_compute_mask_ptr(mask[j].ctypes.data, words * 4)  # type: ignore[union-attr]
        # an additive 0 / -inf bias (a table lookup): cheaper on CPU than masked_fill with a bool mask
        bias = torch.from_numpy(np.take(_BIAS, _bits(mask, logits.shape[1])))
        bias = bias.to(device=logits.device, dtype=logits.dtype)
        if len(rows) == logits.shape[0]:
            logits = logits + bias
        else:
            logits = logits.index_add(0, torch.tensor(rows, device=logits.device), bias)
        self.stats.mask_steps += 1
        self.stats.mask_rows += len(rows)
        self.stats.mask_seconds += time.perf_counter() - started
        return logits

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
