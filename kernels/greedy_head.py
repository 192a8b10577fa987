"""Greedy rows' next tokens without the whole float32 LM head: a half-precision screen, then the exact
product over the few features that can still win.

A greedy decode step needs only each row's argmax of ``x @ W.T``, yet the float32 product streams the
whole ``[vocab, hidden]`` weight (SmolLM2: 113 MB, a fifth of its weights). ``GreedyHead``
keeps an IEEE half copy ``Q`` of ``W`` (half the bytes) and, per step:

1. screen (``cpu_greedy.c``): ``y = x @ Q.T`` in float32 arithmetic (the half weights converted as read);
2. bound: for each feature r, ``|z_r - y_r| <= |x| c_r``, where ``z_r`` is the float32 product's logit;
3. candidates: the features r with ``y_r + |x| c_r >= max_s (y_s - |x| c_s)`` for some row;
4. exact: the float32 product of the rows over the candidates' weight rows only, with the same kernel
   the full product uses (``NativeOps.linear``), and each row's argmax among them.

The contract: ``argmax(x)`` returns, for each row, the token the full product's (the LM head's native
product, ``NativeOps.linear(x, W)``) ``argmax(-1)`` returns, bitwise (ties to the lowest id), or ``None``
when it cannot promise that (a non-finite or near-zero row, more than ``MAX_CANDIDATES`` candidates) or would
not be faster (a row count outside ``1..MAX_ROWS``); the caller then takes the full product.

Why it is exact:

- The bound. With ``u = 2**-24`` and ``g = k u / (1 - k u)`` (``k`` = hidden size), any float32 dot
  product of length ``k`` (any summation order, with or without FMA) is within
  ``g sum|x_i||w_i| <= g |x| |w|`` of the real one. So ``|z_r - y_r| <= |x| (|w_r - q_r| + g (|w_r| +
  |q_r|))``: the real products differ by at most ``|x| |w_r - q_r|`` (Cauchy-Schwarz), and each float32
  one by its rounding. ``c_r`` is that coefficient computed at load (``error_coefficients``: float32,
  within a few ``g`` of the real value), times 1.05, plus 1e-30: the margin covers that and the float32
  arithmetic of steps 2-3 (each of its roundings is below ``u / g`` of the bound, under 2% for
  ``k >= 64``); the ``1e-30`` covers underflow, which the screen refuses below ``|x| = 1e-10``.
- The winner is a candidate: its exact logit is at least every other's, so ``y_win + B_win >= z_win >=
  z_s >= y_s - B_s`` for every s. Every feature tied with it is a candidate too.
- The exact step computes each candidate's logit bitwise as the full product would: the packed product
  (``NativeOps.packed_linear``, which the LM head's ``PreparedLinear`` runs) computes each output as one
  FMA chain over its weight row and its row of ``x``, whatever the other rows and features, so the
  candidates' rows packed alone give the same logits.

Only for the native float32 kernel on one rank (``CausalLM.prepare_linears`` builds it when the LM head
takes ``NativeOps.linear``); ``PDSERVE_GREEDY_HEAD=0`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_native import load_library
from kernels.linear import PreparedLinear
from kernels.native_ops import NativeOps, native_ops

MAX_CANDIDATES = 512  # features rechecked exactly; above it, the full product (counted in ``fallbacks``)
# rows the screen takes: up to 16 it was as fast as the float32 product or faster in whole decode steps
# (docs/benchmarks.md, "The greedy head"); above, the screen's arithmetic costs more than the half stream
# saves (32 rows, one thread, weights warm: 24.4 ms against 21.9)
MAX_ROWS = 16
MARGIN = 1.05
ABSOLUTE = 1e-30
MIN_HIDDEN = 64  # the margin's argument needs k >= 64


def error_coefficients(weight: torch.Tensor, half: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """``c_r`` of the module docstring for each row of ``weight`` and its half copy, ``chunk`` rows at a
    time. In float32: ``w - q`` is exact (Sterbenz: ``q`` is ``w`` rounded to half, within a factor 2 of
    it), and each norm is within ``g`` (relative) of its real value, far inside ``MARGIN``."""
    k = weight.shape[1]
    u = 2.0 ** -24
    g = k * u / (1 - k * u)
    parts = []
    for start in range(0, weight.shape[0], chunk):
        w = weight[start:start + chunk]
        q = half[start:start + chunk].float()
        delta = torch.linalg.vector_norm(w - q, dim=1)
        parts.append(delta + g * (torch.linalg.vector_norm(w, dim=1) + torch.linalg.vector_norm(q, dim=1)))
    c = torch.cat(parts) if parts else weight.new_empty(0)
    return c * (MARGIN * (1 + 4 * g)) + ABSOLUTE

class GreedyHead:
    """The screen over one LM head weight; see the module docstring for ``argmax``'s contract."""

    def __init__(self, weight: torch.Tensor, ops: NativeOps, half: torch.Tensor | None = None) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("the native kernel library is unavailable")
        self.weight = weight.detach()
        self.half = (half if half is not None else self.weight.half()).contiguous()
        self.coefficients = error_coefficients(self.weight, self.half)
        self._ops = ops
        self._screen = lib.pdserve_screen_f16
        self._candidates = lib.pdserve_screen_candidates
        self.steps = 0  # calls answered by the screen
        self.fallbacks = 0  # calls left to the full product
        self.candidates = 0  # candidates rechecked, over ``steps``

    @classmethod
    def build(cls, linear: PreparedLinear) -> GreedyHead | None:
        """The screen for ``linear`` (the LM head), or None where it does not apply: not the native
        float32 kernel on CPU, a bias, a hidden size under ``MIN_HIDDEN``, a weight beyond half
        precision's range."""
        ops = native_ops()
        w = linear.weight
        if (ops is None or linear.kernel != "native"
                or linear.bias is not None or w.dtype != torch.float32 or w.device.type != "cpu"
                or not w.is_contiguous() or w.shape[1] < MIN_HIDDEN):
            return None
        half = w.half()
        if not bool(torch.isfinite(half).all()):
            return None
        return cls(w, ops, half)

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the weight: the half copy and the coefficients."""
        return self.half.numel() * 2 + self.coefficients.numel() * 4

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's token (int64 ``[rows]``) as the full float32 product picks it, or None."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if not 1 <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        x = x.contiguous()
        vocab, k = self.weight.shape
        y = x.new_empty(rows, vocab)
        self._screen(self.half.data_ptr(), x.data_ptr(), y.data_ptr(), rows, vocab, k,
                     torch.get_num_threads())
        found = torch.empty(MAX_CANDIDATES, dtype=torch.int64)
        count = int(self._candidates(y.data_ptr(), self.coefficients.data_ptr(), x.data_ptr(), rows, vocab, k,
                                     ctypes.c_void_p(found.data_ptr()), MAX_CANDIDATES))
        if count <= 0:
            self.fallbacks += 1
            return None
        ids = found[:count]
        exact = self._ops.linear(x, self.weight.index_select(0, ids), None)
        self.steps += 1
        self.candidates += count
        return ids[exact.argmax(dim=1)]
