"""``PrefixIndex.agreement`` (what ``GET /v1/prefix_index`` reports): the index against a snapshot."""

from __future__ import annotations

from messages.wire import KvEvents, KvSnapshot
from router.prefix_index import IndexAgreement, PrefixIndex


def test_agreement_counts_both_directions() -> None:
    index = PrefixIndex(block_size=16, seed=0)
    assert index.apply(KvEvents("decode-0", 1, [1, 2, 3], []))
    same = IndexAgreement("decode-0", 3, 3, 0, 0, True)
    assert index.agreement(KvSnapshot("decode-0", 1, [3, 2, 1])) == same
    # the worker evicted 3 and cached 4 and 5; the index has not folded those events in yet
    lagging = IndexAgreement("decode-0", 3, 4, 2, 1, False)
    assert index.agreement(KvSnapshot("decode-0", 2, [1, 2, 4, 5])) == lagging
    assert index.apply(KvEvents("decode-0", 2, [4, 5], [3]))
    assert index.agreement(KvSnapshot("decode-0", 2, [1, 2, 4, 5])).agrees
    assert index.agreement(KvSnapshot("prefill-0", 0, [])) == IndexAgreement("prefill-0", 0, 0, 0, 0, True)
