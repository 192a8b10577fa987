"""Paged attention in plain torch: the CPU backend and the reference for the others.

``prepare`` turns one step's metadata into a few *groups*, planned once and
shared by every layer: all decodes (``q_len == 1``) form one group, and each
prefill chunk is a group of its own. A group of ``n`` sequences with ``q_len``
queries each reads ``max_len`` cache rows per sequence (padded; padding reads a
valid row and is masked out) through a precomputed gather index, and runs one
``scaled_dot_product_attention`` with a boolean mask that is both the padding
and the causal mask (query ``i`` of a sequence of length ``L`` sees keys at
positions ``<= L - q_len + i``).

A quantized cache is written first (so the stored codes are what later steps
read), and each query then sees the earlier tokens as stored (codes times
scales; int4: two codes a byte, a low and a step per group, ``kernels/kv_int4.py``)
but its *own* key and value unquantized: a decode row gets its own row
overwritten with the exact K/V, and a prefill chunk gets its exact K/V as
``q_len`` extra key columns that query ``i`` alone sees (its own cache row is
masked). Since a token's own K/V is always computed in the step that attends
with it, the result does not depend on how the prompt was chunked or whether a
prefix came from the cache, and it is more accurate than reading the own token
back from the codes.

GQA never repeats K/V: the query heads of one KV head are folded into the query
length, ``[n, kv_heads, q_len * q_per_kv, head_dim]``, and the mask rows are
repeated to match.

Per-layer features (``AttentionBackend``): a sliding ``window`` narrows the group's mask (one mask per
window, built by the first layer that asks); a ``softcap`` or attention ``sinks`` take the explicit
product-softmax-product in float32 instead of SDPA (a sink is one more logit column per query head
whose value is zero). Gathers land in a workspace that is reused across layers and
steps, since fresh multi-megabyte allocations page-fault on CPU.

Attention mass (``mass``, for ``--kv-eviction``, ``engine/kv_eviction.py``): when the backend is
given a float32 ``[num_blocks, layers x kv_heads]`` tensor, every layer forms its product explicitly and
adds, per cached key, the probability the query heads of each KV head gave it (summed over those query
heads and the step's queries) to the key's block, in the column ``layer x kv_heads + kv_head``; a block
written from its first row in a step starts again from zero. The layer is the count of ``forward`` calls
since ``prepare`` (``mass_layer``: the model calls every layer once a step, in order). Over a quantized
cache a prompt chunk's own exact keys count for the blocks their positions lie in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import kv_int4
from kernels.attention import AttentionMetadata
from kernels.kv_quant import codes_to_float, is_quantized, write_quantized


def _additive_mask(visible: torch.Tensor, q_per_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``[n, q_len, width]`` -> additive ``[n, 1, q_len * q_per_kv, width]``, each query
    row repeated for the query heads folded into it (SDPA converts boolean masks every call)."""
    n, q_len, width = visible.shape
    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    additive.masked_fill_(~visible, float("-inf"))
    return (
        additive[:, None, :, None, :]
        .expand(n, 1, q_len, q_per_kv, width)
        .reshape(n, 1, q_len * q_per_kv, width)
    )


@dataclass
class _Group:
    """Sequences attended together. ``tokens`` selects their rows of ``q``."""

    tokens: slice | torch.Tensor
    num_seqs: int
    q_len: int
    rows: torch.Tensor  # int64 [n, max_len]: K row of each key in kv_layer.view(-1, kv_heads, head_dim)
    mask: torch.Tensor  # bool [n, q_len, max_len]: True where a query may attend
    # built by the first layer, reused by the rest: kv_heads -> gather index; (q_per_kv, window) -> mask
    head_index: dict[int, torch.Tensor] = field(default_factory=dict)
    sdpa_mask: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)
    scale_index: dict[int, torch.Tensor] = field(default_factory=dict)
    own_positions: torch.Tensor | None = None
    own_mask: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)
    window_mask: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        return int(self.rows.shape[1])

    def positions(self) -> torch.Tensor:
        """Cache positions ``[n, q_len]`` of the group's own query tokens."""
        if self.own_positions is None:
            self.own_positions = self.mask.sum(dim=2) - 1  # query i sees positions <= its own
        return self.own_positions

    def visible(self, window: int | None) -> torch.Tensor:
        """Boolean ``[n, q_len, max_len]``: the causal mask, narrowed to the last ``window`` positions."""
        if window is None:
            return self.mask
        mask = self.window_mask.get(window)
        if mask is None:
            pos = torch.arange(self.max_len, device=self.mask.device)
            mask = self.mask & (pos[None, None, :] > self.positions()[:, :, None] - window)
            self.window_mask[window] = mask
        return mask

    def own_attn_mask(self, q_per_kv: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """Additive mask ``[n, 1, q_len * q_per_kv, max_len + q_len]`` for :meth:`attn_mask`'s
        keys followed by the step's own exact keys: query ``i`` sees the cache strictly before
        its own position, and of the extra columns only column ``i``."""
        mask = self.own_mask.get((q_per_kv, window))
        if mask is None or mask.dtype != dtype:
            n, q_len, max_len = self.mask.shape
            pos = torch.arange(max_len, device=self.mask.device)
            before = self.visible(window) & (pos[None, None, :] != self.positions()[:, :, None])
            own = torch.eye(q_len, dtype=torch.bool, device=self.mask.device).expand(n, q_len, q_len)
            mask = _additive_mask(torch.cat((before, own), dim=2), q_per_kv, dtype)
            self.own_mask[(q_per_kv, window)] = mask
        return mask

    def gather_index(self, kv_heads: int, block_size: int) -> torch.Tensor:
        """Rows of ``kv_layer.view(-1, head_dim)`` for K then V, laid out ``[2, n, kv_heads, max_len]``."""
        index = self.head_index.get(kv_heads)
        if index is None:
            heads = torch.arange(kv_heads, device=self.rows.device)
            k_rows = self.rows[:, None, :] * kv_heads + heads[None, :, None]
            index = torch.stack((k_rows, k_rows + block_size * kv_heads)).reshape(-1)
            self.head_index[kv_heads] = index
        return index

    def scales_index(self, kv_heads: int, block_size: int) -> torch.Tensor:
        """Rows of ``scales_layer.view(-1)`` matching :meth:`gather_index`, ``[2, n, kv_heads, max_len]``."""
        index = self.scale_index.get(kv_heads)
        if index is None:
            blocks = torch.div(self.rows, 2 * block_size, rounding_mode="floor")
            heads = torch.arange(kv_heads, device=self.rows.device)
            k_idx = (blocks[:, None, :] * 2) * kv_heads + heads[None, :, None]
            index = torch.stack((k_idx, k_idx + kv_heads))
            self.scale_index[kv_heads] = index
        return index

    def attn_mask(self, q_per_kv: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """Additive mask ``[n, 1, q_len * q_per_kv, max_len]`` (SDPA converts boolean masks every call)."""
        mask = self.sdpa_mask.get((q_per_kv, window))
        if mask is None or mask.dtype != dtype:
            mask = _additive_mask(self.visible(window), q_per_kv, dtype)
            self.sdpa_mask[(q_per_kv, window)] = mask
        return mask


@dataclass(frozen=True)
class LayerFeatures:
    """A layer's ``window``, ``sinks`` and ``softcap`` (``AttentionBackend``); all None: plain attention."""

    window: int | None = None
    sinks: torch.Tensor | None = None
    softcap: float | None = None

    @property
    def explicit(self) -> bool:
        """Whether the scores must be formed explicitly (SDPA has no softcap and no sinks)."""
        return self.sinks is not None or self.softcap is not None


PLAIN = LayerFeatures()


def _explicit_attention(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        scale: float, features: LayerFeatures, q_len: int,
                        probs_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Softmax attention formed step by step in float32: scores, softcap, mask, sinks, softmax, values;
    ``probs_out`` receives the probabilities ``[n, kv_heads, rows, keys]`` (sinks left out)."""
    scores = torch.matmul(qg.float(), keys.float().transpose(-1, -2)) * scale
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    scores = scores + mask.float()
    sinks = features.sinks
    if sinks is not None:
        n, kv_heads, rows, _ = scores.shape
        q_per_kv = rows // q_len
        sink = (sinks.float().to(scores.device).view(kv_heads, 1, q_per_kv).expand(kv_heads, q_len, q_per_kv)
                .reshape(1, kv_heads, rows, 1).expand(n, kv_heads, rows, 1))
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    if probs_out is not None:
        probs_out.append(probs)
    return torch.matmul(probs, values.float()).to(keys.dtype)


def _grouped_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  n: int, q_len: int, scale: float, features: LayerFeatures = PLAIN,
                  probs_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    """SDPA of ``q`` (``[n * q_len, num_heads, head_dim]``) over ``keys``/``values``
    (``[n, kv_heads, L, head_dim]``) with the query heads of each KV head folded into the
    query length; computed in the keys' dtype, returned in ``q``'s. With ``probs_out`` the
    product is formed explicitly and its probabilities are appended there."""
    _, kv_heads, _, head_dim = keys.shape
    q_per_kv = q.shape[1] // kv_heads
    qg = (
        q.reshape(n, q_len, kv_heads, q_per_kv, head_dim)
        .transpose(1, 2)
        .reshape(n, kv_heads, q_len * q_per_kv, head_dim)
        .to(keys.dtype)
    )
    if features.explicit or probs_out is not None:
        out = _explicit_attention(qg, keys, values, mask, scale, features, q_len, probs_out)
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return (
        out.view(n, kv_heads, q_len, q_per_kv, head_dim)
        .transpose(1, 2)
        .reshape(n * q_len, kv_heads * q_per_kv, head_dim)
        .to(q.dtype)
    )


def _as_slice(indices: list[int]) -> slice | None:
    if indices and indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return None


class TorchAttentionBackend:
    """``AttentionBackend`` for any torch device; exact in float32."""

    features = frozenset({"window", "sinks", "softcap"})

    def __init__(self, mass: torch.Tensor | None = None) -> None:
        # attention mass per block, layer and KV head (``engine/kv_eviction.py``): float32
        # ``[num_blocks, layers x kv_heads]``, or None; ``mass_layer``: the layer the next forward scores
        self.mass = mass
        self.mass_layer = 0
        self._meta: AttentionMetadata | None = None
        self._groups: list[_Group] = []
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._slots = torch.empty(0, dtype=torch.int64)
        self._workspace: torch.Tensor | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        bs = meta.block_size
        slots = meta.slot_mapping.to(torch.int64)
        self._write_rows = torch.div(slots, bs, rounding_mode="floor") * (2 * bs) + slots % bs
        self._slots = slots
        self._meta = meta
        self.mass_layer = 0
        if self.mass is not None:  # a block written from its first row has a new owner: its mass restarts
            fresh = torch.div(slots[slots % bs == 0], bs, rounding_mode="floor")
            self.mass.index_fill_(0, fresh.to(self.mass.device), 0.0)
        starts = [0]
        for q_len in meta.query_lens_list:
            starts.append(starts[-1] + q_len)
        decodes = [s for s, q in enumerate(meta.query_lens_list) if q == 1]
        groups: list[_Group] = []
        if decodes:
            token_ids = [starts[s] for s in decodes]
            tokens: slice | torch.Tensor | None = _as_slice(token_ids)
            if tokens is None:
                tokens = torch.tensor(token_ids, dtype=torch.int64, device=device)
            groups.append(self._plan(meta, decodes, tokens, 1, device))
        for s, q_len in enumerate(meta.query_lens_list):
            if q_len > 1:
                groups.append(self._plan(meta, [s], slice(starts[s], starts[s] + q_len), q_len, device))
        self._groups = groups

    @staticmethod
    def _plan(
        meta: AttentionMetadata,
        seqs: list[int],
        tokens: slice | torch.Tensor,
        q_len: int,
        device: torch.device,
    ) -> _Group:
        bs = meta.block_size
        lens = torch.tensor([meta.seq_lens_list[s] for s in seqs], dtype=torch.int64)
        max_len = int(lens.max())
        num_blocks = -(-max_len // bs)
        padded = [meta.block_tables_list[s][:num_blocks] for s in seqs]
        padded = [t + [0] * (num_blocks - len(t)) for t in padded]
        tables = torch.tensor(padded, dtype=torch.int64).reshape(len(seqs), num_blocks)
        pos = torch.arange(max_len, dtype=torch.int64)
        rows = tables[:, pos // bs] * (2 * bs) + pos % bs
        # query i of a sequence of length L sits at position L - q_len + i
        last_visible = lens[:, None] - q_len + torch.arange(q_len, dtype=torch.int64)[None, :]
        mask = pos[None, None, :] <= last_visible[:, :, None]
        return _Group(
            tokens=tokens, num_seqs=len(seqs), q_len=q_len, rows=rows.to(device), mask=mask.to(device)
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        try:
            return self._forward(q, k, v, kv_layer, scale, kv_scales, window, sinks, softcap)
        finally:
            self.mass_layer += 1

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 scale: float, kv_scales: torch.Tensor | None, window: int | None,
                 sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("TorchAttentionBackend.forward called before prepare")
        if window is not None and window < 1:
            raise ValueError(f"attention window must be at least 1, got {window}")
        features = PLAIN if window is None and sinks is None and softcap is None else \
            LayerFeatures(window, sinks, softcap)
        bs = self._meta.block_size
        _, _, _, kv_heads, head_dim = kv_layer.shape
        num_heads = q.shape[1]
        q_per_kv = num_heads // kv_heads
        if is_quantized(kv_layer.dtype):
            if kv_scales is None:
                raise ValueError(f"a {kv_layer.dtype} KV cache needs its scales")
            write_quantized(kv_layer, kv_scales, k, v, self._slots, bs)
        else:
            rows = kv_layer.view(-1, kv_heads, head_dim)
            rows.index_copy_(0, self._write_rows, k.to(kv_layer.dtype))
            rows.index_copy_(0, self._write_rows + bs, v.to(kv_layer.dtype))
        flat = kv_layer.view(-1, head_dim)
        scales = None
        if kv_scales is not None and is_quantized(kv_layer.dtype):  # a row per (block, part, head)
            scales = kv_scales.view(-1, *kv_scales.shape[3:])  # [blocks, parts, heads, ...] per layer
        fresh = (k, v) if scales is not None else None
        if len(self._groups) == 1 and self._covers_all(self._groups[0], q.shape[0]):
            return self._attend(self._groups[0], q, flat, kv_heads, q_per_kv, bs, scale, scales, fresh,
                                features)
        out = torch.empty_like(q)
        for group in self._groups:
            out[group.tokens] = self._attend(
                group, q[group.tokens], flat, kv_heads, q_per_kv, bs, scale, scales,
                None if fresh is None else (fresh[0][group.tokens], fresh[1][group.tokens]), features,
            )
        return out

    @staticmethod
    def _covers_all(group: _Group, num_tokens: int) -> bool:
        return isinstance(group.tokens, slice) and group.tokens == slice(0, num_tokens)

    def _attend(
        self,
        group: _Group,
        q: torch.Tensor,
        flat: torch.Tensor,
        kv_heads: int,
        q_per_kv: int,
        block_size: int,
        scale: float,
        scales: torch.Tensor | None = None,
        fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
        features: LayerFeatures = PLAIN,
    ) -> torch.Tensor:
        """Attention for one group: ``q`` is ``[n * q_len, num_heads, head_dim]``.

        With ``scales`` (a quantized cache) the gathered codes are dequantized to ``q.dtype``.
        """
        n, q_len, max_len = group.num_seqs, group.q_len, group.max_len
        head_dim = flat.shape[1]
        index = group.gather_index(kv_heads, block_size)
        if scales is None:
            kv = self._workspace_for(index.numel() * head_dim, flat)
            torch.index_select(flat, 0, index, out=kv.view(-1, head_dim))
            kv = kv.view(2, n, kv_heads, max_len, head_dim)
        else:
            codes = torch.index_select(flat, 0, index).view(2, n, kv_heads, max_len, head_dim)
            block_scales = scales[group.scales_index(kv_heads, block_size)]
            if kv_int4.is_int4(codes.dtype):
                kv = kv_int4.dequantize(codes, block_scales).to(q.dtype)
            else:
                kv = codes_to_float(codes).mul_(block_scales[..., None]).to(q.dtype)
            if fresh is not None and q_len == 1:
                self._put_fresh(group, kv, fresh)
            elif fresh is not None:
                return self._attend_own_exact(group, q, kv, fresh, q_per_kv, scale, features, block_size)
        mask = group.attn_mask(q_per_kv, kv.dtype, features.window)
        if self.mass is None:
            return _grouped_sdpa(q, kv[0], kv[1], mask, n, q_len, scale, features)
        probs: list[torch.Tensor] = []
        out = _grouped_sdpa(q, kv[0], kv[1], mask, n, q_len, scale, features, probs)
        self._add_mass(group, probs[0].sum(dim=2), block_size)
        return out

    def _attend_own_exact(self, group: _Group, q: torch.Tensor, kv: torch.Tensor,
                          fresh: tuple[torch.Tensor, torch.Tensor], q_per_kv: int,
                          scale: float, features: LayerFeatures = PLAIN, block_size: int = 0) -> torch.Tensor:
        """A prefill group over dequantized ``kv`` plus its own exact K/V (:meth:`_Group.own_attn_mask`).
        With ``mass``, each own key's probability counts for the block its position lies in."""
        n, q_len = group.num_seqs, group.q_len
        _, _, kv_heads, _, head_dim = kv.shape
        own = [t.reshape(n, q_len, kv_heads, head_dim).transpose(1, 2).to(kv.dtype) for t in fresh]
        keys = torch.cat((kv[0], own[0]), dim=2)
        values = torch.cat((kv[1], own[1]), dim=2)
        mask = group.own_attn_mask(q_per_kv, kv.dtype, features.window)
        if self.mass is None:
            return _grouped_sdpa(q, keys, values, mask, n, q_len, scale, features)
        probs: list[torch.Tensor] = []
        out = _grouped_sdpa(q, keys, values, mask, n, q_len, scale, features, probs)
        per_key = probs[0].sum(dim=2)  # [n, kv_heads, max_len + q_len]
        own_at = group.positions()[:, None, :].expand(-1, kv_heads, -1)
        cached = per_key[..., : group.max_len].float().scatter_add(2, own_at,
                                                                   per_key[..., group.max_len :].float())
        self._add_mass(group, cached, block_size)
        return out

    def _add_mass(self, group: _Group, per_key: torch.Tensor, block_size: int) -> None:
        """Add each cached key's probability per KV head (``[n, kv_heads, max_len]``) to the block its row
        lies in, in this layer's columns."""
        assert self.mass is not None
        kv_heads = per_key.shape[1]
        layer = self.mass_layer % (self.mass.shape[1] // kv_heads)
        blocks = torch.div(group.rows, 2 * block_size, rounding_mode="floor")
        columns = self.mass[:, layer * kv_heads : (layer + 1) * kv_heads]
        per_row = per_key.permute(0, 2, 1).reshape(-1, kv_heads).to(self.mass.dtype)
        columns.index_add_(0, blocks.reshape(-1), per_row)

    @staticmethod
    def _put_fresh(group: _Group, kv: torch.Tensor, fresh: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Overwrite the rows of this step's own tokens with their unquantized K/V."""
        n, q_len = group.num_seqs, group.q_len
        pos = group.positions()  # [n, q_len]
        seq = torch.arange(n, device=kv.device)[:, None].expand(n, q_len)
        for i, t in enumerate(fresh):
            kv[i][seq, :, pos] = t.reshape(n, q_len, *t.shape[1:]).to(kv.dtype)

    def _workspace_for(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws[:numel]
