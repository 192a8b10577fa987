"""What one engine step computed, in the terms ``planner/profile.py``'s cost model prices.

``step_work(out)`` counts a scheduled step (``SchedulerOutput``, before it runs: the requests'
``num_computed_tokens`` are the K/V already in place):

- a *decode* step is one whose every chunk is one token of a request that has output already (no
  proposed tokens): ``rows`` requests holding ``context`` tokens in all (each request's K/V plus the
  token it computes: the ``C`` of ``DecodeCost.step_s(B, C)``, as ``planner/profiler.py`` measures it);
- any other step carries a prompt (a prefill worker's chunks, or prompts computed beside decode rows):
  ``tokens`` new tokens and ``attended`` (query, key) pairs, a chunk of ``n`` tokens after ``k`` in the
  cache attending ``n * (k + (n + 1) / 2)`` (``PrefillCost.step_s(N, A)``; a decode row in such a step is
  a one-token chunk).

The profile's costs are linear in these counts, so running totals price any number of steps at once:
``StepTotals`` (kept by ``engine/async_engine.py``'s ``StepClock`` beside each kind's wall seconds, and
reported in ``WorkerStats``) gives ``base * steps + per_row * rows + per_context * context`` for the
decode steps and ``base * steps + per_token * tokens + per_attended * attended`` for the others.
Counting is one pass over the step's chunks: a few operations per running request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepWork:
    """One step's counts (see the module docstring); ``context`` is 0 for a prefill-carrying step and
    ``attended`` 0 for a decode step."""

    decode: bool
    rows: int
    tokens: int
    context: int
    attended: float


def step_work(out: SchedulerOutput) -> StepWork:
    """Count ``out`` before it runs (see the module docstring)."""
    rows = tokens = context = 0
    attended = 0.0
    decode = True
    for item in out.scheduled:
        r, n = item.request, item.num_new_tokens
        k = r.num_computed_tokens
        rows += 1
        tokens += n
        context += k + n
        attended += n * (k + (n + 1) / 2)
        if n != 1 or item.spec_token_ids or not r.output_token_ids:
            decode = False
    if decode:
        return StepWork(True, rows, tokens, context, 0.0)
    return StepWork(False, rows, tokens, 0, attended)


@dataclass
class StepTotals:
    """Running totals of ``StepWork`` and the wall seconds of the steps counted, per kind."""

    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_rows: int = 0
    decode_context: int = 0
    prefill_steps: int = 0
    prefill_wall_s: float = 0.0
    prefill_tokens: int = 0
    prefill_attended: float = 0.0

    def add(self, work: StepWork, wall_s: float) -> None:
        if work.decode:
            self.decode_steps += 1
            self.decode_wall_s += wall_s
            self.decode_rows += work.rows
            self.decode_context += work.context
        else:
            self.prefill_steps += 1
            self.prefill_wall_s += wall_s
            self.prefill_tokens += work.tokens
            self.prefill_attended += work.attended
