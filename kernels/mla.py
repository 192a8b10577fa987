"""Multi-head latent attention over a paged latent cache: the torch reference, in both forms.

Cache layout (``kernels/attention.py``'s, with one part and one head): ``kv_layer`` is
``[num_blocks, 1, block_size, 1, latent_dim]``, token ``t``'s row holding its RMSNormed latent
(``kv_lora_rank`` values) then its rotated rotary key (``qk_rope_head_dim``), shared by every head.
``forward`` first writes the step's new rows at ``meta.slot_mapping``, then attends. A quantized cache
(fp8/int8, ``kernels/kv_quant.py``) has one scale per block beside it (``kv_scales``
``[num_blocks, 1, 1]``): rows are written through ``write_quantized_rows`` and read back dequantized
with their block's scale, so both forms see the same float32 latents.

Per head ``h``, with ``w_uk[h]`` ``[qk_nope, rank]`` and ``w_uv[h]`` ``[v_dim, rank]`` (the two halves
of ``kv_b_proj``), the score of key ``t`` is ``q_nope . (w_uk c_t) + q_rope . k_rope_t`` and the value
``w_uv c_t``. Two forms compute it:

- expanded (prompt chunks): the context's latents up-projected to per-head keys and values, then
  ordinary causal attention per head;
- absorbed (decode rows): ``w_uk`` folded into the query (``q_lat = w_uk[h]^T q_nope``) so attention
  runs over the latent rows themselves, reading ``latent_dim`` values per cached token for all heads
  at once, and ``w_uv`` applied to each head's mix of latents afterwards.

They are the same sum in another order (equal to rounding, tests/unit/test_mla.py). ``absorb`` picks
the form per group of the step: decode rows (``q_len`` 1) absorbed, prompt chunks expanded, unless
forced. Scores and softmax in float32; causal masking as every backend's (query ``i`` of a
sequence of ``L`` tokens with ``q_len`` new sits at ``L - q_len + i``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels.attention import AttentionMetadata
from kernels.kv_quant import codes_to_float, write_quantized_rows


@dataclass
class SeqGroup:
    """Sequences of one step attended together: every decode row, or one prompt chunk."""

    tokens: slice | torch.Tensor  # the group's rows of the step's tokens
    q_len: int
    block_size: int
    width: int  # L: the longest sequence's length
    lens: torch.Tensor  # int32 [n]: each sequence's length (the kernels' seq_lens)
    tables: torch.Tensor  # int32 [n, ceil(L / block_size)]: each sequence's blocks, zero-padded

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """int64 ``[n, L]``: the cache row (block * block_size + offset) of each key position (the torch
        forms' gather; the kernels read the tables)."""
        bs = self.block_size
        pos = torch.arange(self.width, device=self.tables.device)
        return self.tables.long()[:, pos // bs] * bs + pos % bs

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """bool ``[n, q_len, L]``: which key positions each query sees (causal)."""
        device = self.lens.device
        pos = torch.arange(self.width, device=device)
        last = self.lens.long()[:, None] - self.q_len + torch.arange(self.q_len, device=device)[None, :]
        return pos[None, None, :] <= last[:, :, None]


class MlaTorchBackend:
    """MLA attention for any torch device (see the module docstring)."""

    features: frozenset[str] = frozenset()

    def __init__(self, absorb: bool | None = None) -> None:
        self.absorb = absorb  # None: absorbed for decode rows, expanded for prompt chunks
        self._meta: AttentionMetadata | None = None
        self._groups: list[SeqGroup] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        starts = [0]
        for q_len in meta.query_lens_list:
            starts.append(starts[-1] + q_len)
        decodes = [s for s, q in enumerate(meta.query_lens_list) if q == 1]
        groups = []
        if decodes:
            device = meta.slot_mapping.device
            index = torch.tensor([starts[s] for s in decodes], dtype=torch.int64, device=device)
            groups.append(self._plan(meta, decodes, index, 1))
        for s, q_len in enumerate(meta.query_lens_list):
            if q_len > 1:
                groups.append(self._plan(meta, [s], slice(starts[s], starts[s] + q_len), q_len))
        self._groups = groups

    @staticmethod
    def _plan(meta: AttentionMetadata, seqs: list[int], tokens: slice | torch.Tensor, q_len: int) -> SeqGroup:
        bs = meta.block_size
        lens = [meta.seq_lens_list[s] for s in seqs]
        blocks = -(-max(lens) // bs)
        tables = [meta.block_tables_list[s][:blocks] for s in seqs]
        device = meta.slot_mapping.device
        return SeqGroup(tokens, q_len, bs, max(lens), torch.tensor(lens, dtype=torch.int32, device=device),
                        torch.tensor([t + [0] * (blocks - len(t)) for t in tables], dtype=torch.int32,
                                     device=device))

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                kv_layer: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``[T, heads, v_dim]`` for queries ``q_nope`` ``[T, heads, qk_nope]`` and
        ``q_rope`` ``[T, heads, qk_rope]`` (rotated), after writing ``latent`` ``[T, latent_dim]``."""
        meta = self._meta
        if meta is None:
            raise RuntimeError("MlaTorchBackend.forward called before prepare")
        slots = meta.slot_mapping.to(torch.int64)
        flat = kv_layer.view(-1, kv_layer.shape[-1])
        if kv_scales is None:
            flat.index_copy_(0, slots, latent.to(flat.dtype))
        else:
            write_quantized_rows(kv_layer, kv_scales, latent[:, None, None, :], slots, meta.block_size)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
        for group in self._groups:
            q_n, q_r = _split(group, q_nope[group.tokens]), _split(group, q_rope[group.tokens])
            absorbed = group.q_len == 1 if self.absorb is None else self.absorb
            if absorbed:
                query = torch.cat((torch.einsum("nqhd,hdr->nqhr", q_n, w_uk.float()), q_r), dim=-1)
                mixed = self.mix(group, query.contiguous(), kv_layer, kv_scales, w_uk.shape[2], scale)
                res = torch.einsum("nqhr,hvr->nqhv", mixed, w_uv.float())
            else:
                res = _expanded(group, q_n, q_r, _gather(group, flat, kv_scales, meta.block_size), w_uk, w_uv,
                                scale)
            out[group.tokens] = res.reshape(-1, *res.shape[2:]).to(out.dtype)
        return out

    def mix(self, group: SeqGroup, query: torch.Tensor, kv_layer: torch.Tensor,
            kv_scales: torch.Tensor | None, rank: int, scale: float) -> torch.Tensor:
        """The absorbed form's attention: for absorbed queries ``[n, q_len, heads, latent_dim]`` (float32),
        each query's softmax mix of the cached latents, ``[n, q_len, heads, rank]`` float32. The native
        and Triton backends (``kernels/mla_backends.py``) replace it for decode rows."""
        rows = _gather(group, kv_layer.view(-1, kv_layer.shape[-1]), kv_scales, kv_layer.shape[2])
        scores = torch.einsum("nqhc,nlc->nhql", query, rows) * scale
        probs = _softmax(scores, group.mask[:, None])
        return torch.einsum("nhql,nlr->nqhr", probs, rows[..., :rank])


def _gather(group: SeqGroup, flat: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int
            ) -> torch.Tensor:
    """The group's cached rows ``[n, L, latent_dim]`` in float32 (dequantized with their blocks' scales)."""
    index = group.rows.reshape(-1)
    if kv_scales is None:
        rows = flat.index_select(0, index).float()
    else:
        scales = kv_scales.reshape(-1).index_select(0, torch.div(index, block_size, rounding_mode="floor"))
        codes = flat.view(torch.uint8).index_select(0, index).view(flat.dtype)  # CPU: no float8 gather
        rows = codes_to_float(codes) * scales[:, None]
    return rows.view(*group.rows.shape, -1)


def _split(group: SeqGroup, q: torch.Tensor) -> torch.Tensor:
    """``[n * q_len, heads, d]`` -> ``[n, q_len, heads, d]`` in float32."""
    return q.float().reshape(group.rows.shape[0], group.q_len, *q.shape[1:])


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def _expanded(group: SeqGroup, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
              w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n, q_len, heads, v_dim]`` for split float32 queries, from the up-projected keys and values."""
    rank = w_uk.shape[2]
    latent, k_rope = rows[..., :rank], rows[..., rank:]
    k_nope = torch.einsum("nlr,hdr->nlhd", latent, w_uk.float())
    values = torch.einsum("nlr,hvr->nlhv", latent, w_uv.float())
    keys = torch.cat((k_nope, k_rope[:, :, None].expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
    query = torch.cat((q_nope, q_rope), dim=-1)
    scores = torch.einsum("nqhd,nlhd->nhql", query, keys) * scale
    probs = _softmax(scores, group.mask[:, None])
    return torch.einsum("nhql,nlhv->nqhv", probs, values)
