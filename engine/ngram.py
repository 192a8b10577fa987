"""N-gram (prompt lookup) proposals: copy what followed an earlier occurrence of the latest tokens.

``propose_ngram(tokens, k, min_n, max_n)``: for ``n`` from ``max_n`` down to ``min_n``, find the
most recent earlier occurrence of the sequence's last ``n`` tokens (prompt and output alike: on a
decode worker that is the prompt the prefill worker computed plus what was generated since) and
return up to ``k`` of the tokens that followed it; the longest matching ``n`` wins. No match (or a
sequence shorter than ``min_n + 1``) proposes nothing. The proposal is a deterministic function of
the tokens, so as a distribution it is a point mass (``engine/rejection.py`` relies on that).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following the most recent earlier match of the longest suffix n-gram."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # candidate ends: positions p < length - 1 holding the last token (a match must leave a follower)
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        ok = ends[ends >= n - 1]
        for back in range(1, n):  # compare the earlier tokens of each candidate, newest test first
            if ok.size == 0:
                break
            ok = ok[arr[ok - back] == suffix[n - 1 - back]]
        if ok.size:
            start = int(ok[-1]) + 1
            return [int(t) for t in arr[start:start + k]]
    return []
