"""Plain-Python planning of flashinfer's paged-KV arrays from our ``AttentionMetadata``.

flashinfer describes a batch by four arrays (its "page table layout"):

* ``qo_indptr`` ``[n + 1]``: request ``i``'s query rows are ``qo_indptr[i]:qo_indptr[i+1]``;
* ``kv_indptr`` ``[n + 1]``: its pages are ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``;
* ``kv_indices``: page (block) ids, each request's in position order;
* ``kv_last_page_len`` ``[n]``: valid rows of its last page, in ``1..page_size``.

Invariants the planner keeps (and tests check): a request with ``L`` tokens has
exactly ``ceil(L / page_size)`` pages (the zero padding of our block tables never
reaches flashinfer), ``(pages - 1) * page_size + last_page_len == L``, and decodes
(one query row) come first, in their original order, then prefill chunks. ``order``
is the sequence permutation; ``token_order`` gathers our query rows into planned
order (``None`` when the batch is already decodes-first), and the output is
scattered back with the same index.

Per-layer features (``AttentionBackend.forward``'s keywords) map onto flashinfer's own plan
parameters where it has them (``flashinfer_variant``): a window of W keys is
``window_left = W - 1`` (flashinfer's query at ``p`` attends ``[p - window_left, p]``), a
softcap ``c`` is ``logits_soft_cap = c`` (flashinfer caps ``x = q.k * sm_scale`` as
``c * tanh(x / c)``). Attention sinks are not one of them: flashinfer's paged prefill wrapper
takes no sink logits on the sm_80/sm_90 kernels this backend runs, so a layer with sinks gets
``None`` and the backend runs it on the Triton kernels instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata


@dataclass(frozen=True)
class FlashInferPlan:
    page_size: int
    order: list[int]  # planned position -> our sequence index
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]
    token_order: list[int] | None  # planned query row -> our query row

    @property
    def num_decodes(self) -> int:
        return sum(1 for a, b in zip(self.qo_indptr, self.qo_indptr[1:], strict=False) if b - a == 1)


def plan_flashinfer(meta: AttentionMetadata) -> FlashInferPlan:
    """The four flashinfer arrays for one step, decodes first."""
    bs = meta.block_size
    q_lens = meta.query_lens_list
    order = [s for s, q in enumerate(q_lens) if q == 1] + [s for s, q in enumerate(q_lens) if q != 1]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    qo_indptr, kv_indptr = [0], [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    token_order: list[int] = []
    for s in order:
        seq_len = meta.seq_lens_list[s]
        pages = -(-seq_len // bs)
        table = meta.block_tables_list[s]
        if pages > len(table):
            raise ValueError(f"sequence {s}: {seq_len} tokens need {pages} blocks, table has {len(table)}")
        kv_indices.extend(table[:pages])
        kv_indptr.append(kv_indptr[-1] + pages)
        last_page_len.append(seq_len - (pages - 1) * bs)
        qo_indptr.append(qo_indptr[-1] + q_lens[s])
        token_order.extend(range(starts[s], starts[s + 1]))
    identity = token_order == list(range(len(token_order)))
    return FlashInferPlan(bs, order, qo_indptr, kv_indptr, kv_indices, last_page_len,
                          None if identity else token_order)


@dataclass(frozen=True)
class LayerVariant:
    """flashinfer's plan parameters for one kind of layer; a wrapper is planned per variant."""

    window_left: int = -1  # -1: no window
    logits_soft_cap: float = 0.0  # 0: none


def flashinfer_variant(window: int | None, sinks: torch.Tensor | None,
                       softcap: float | None) -> LayerVariant | None:
    """The variant that gives a layer's features in flashinfer, or None when flashinfer is not given
    one of them (sinks): that layer must run elsewhere."""
    if sinks is not None:
        return None
    return LayerVariant(-1 if window is None else window - 1, 0.0 if softcap is None else float(softcap))
