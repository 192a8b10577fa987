"""Least-squares fits of the profile's cost models to measured samples, in relative error.

Each model is linear in its coefficients, all of which must be >= 0 (a step never gets cheaper with
more work). ``nonnegative_lstsq`` solves the weighted problem and, while a coefficient comes out
negative, drops the most negative one (fixing it at 0) and solves again: the active-set idea of NNLS,
enough for three columns. Rows are weighted by 1 / measured time, so a 5 ms step counts as much as a
2 s one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.profile import (
    DecodeCost,
    DecodeSample,
    PrefillCost,
    PrefillSample,
    TransferCost,
    TransferSample,
    attended_pairs,
)


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising ``|a x - y|`` with the columns that would go negative fixed at 0."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        del active[int(np.argmin(sol))]
    return x


def _relative(rows: list[list[float]], seconds: list[float]) -> np.ndarray:
    a = np.array(rows, dtype=float)
    y = np.array(seconds, dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    return nonnegative_lstsq(a * w[:, None], y * w)


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillCost:
    if len(samples) < 3:
        raise ValueError(f"need at least 3 prefill samples to fit, got {len(samples)}")
    rows = [[1.0, s.new_tokens, attended_pairs(s.new_tokens, s.cached_tokens)] for s in samples]
    base, per_token, per_attended = _relative(rows, [s.seconds for s in samples])
    return PrefillCost(float(base), float(per_token), float(per_attended))


def fit_decode(samples: Sequence[DecodeSample]) -> DecodeCost:
    """Step time = the step at that batch size without context (``by_batch``, one figure per measured
    batch size) + per context token x tokens held; ``base_s`` and ``per_seq_s`` are the straight line
    through the batch sizes' figures. The per-token cost is fitted with the table when some batch size
    was measured at two context sizes, else with the straight line. When every sample has one batch size
    (an engine whose ``max_num_seqs`` is 1 runs no other) there is no table, and the per-request cost
    cannot be told from the base: it is folded into the base and fitted as 0, exact for that batch
    size."""
    seconds = [s.seconds for s in samples]
    batches = sorted({s.batch for s in samples})
    if len(batches) == 1:
        if len({s.context_tokens for s in samples}) < 2:
            raise ValueError(f"need decode samples at 2 context sizes at least to fit, got {len(samples)}")
        rows = [[1.0, s.context_tokens] for s in samples]
        base, per_context = _relative(rows, seconds)
        return DecodeCost(float(base), 0.0, float(per_context))
    if len(samples) < 3:
        raise ValueError(f"need at least 3 decode samples to fit, got {len(samples)}")
    if any(len({s.context_tokens for s in samples if s.batch == b}) >= 2 for b in batches):
        rows = [[float(s.batch == b) for b in batches] + [float(s.context_tokens)] for s in samples]
        *table, per_context = _relative(rows, seconds)
    else:
        per_context = _relative([[1.0, s.batch, s.context_tokens] for s in samples], seconds)[2]
        table = [max(0.0, float(np.mean([s.seconds - per_context * s.context_tokens
                                         for s in samples if s.batch == b]))) for b in batches]
    no_context = [t - per_context * s.context_tokens for t, s in zip(seconds, samples, strict=True)]
    base, per_seq = _relative([[1.0, s.batch] for s in samples], [max(t, 1e-9) for t in no_context])
    return DecodeCost(float(base), float(per_seq), float(per_context),
                      tuple((b, float(t)) for b, t in zip(batches, table, strict=True)))


def fit_transfer(samples: Sequence[TransferSample]) -> TransferCost:
    if len(samples) < 2:
        raise ValueError(f"need at least 2 transfer samples to fit, got {len(samples)}")
    rows = [[1.0, float(s.bytes)] for s in samples]
    base, per_byte = _relative(rows, [s.seconds for s in samples])
    if per_byte <= 0:
        raise ValueError("transfer samples show no cost per byte; measure larger transfers")
    return TransferCost(float(base), float(1.0 / per_byte))
