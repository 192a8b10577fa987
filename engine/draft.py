"""Draft-model proposals for speculative decoding (``{"method": "draft_model", "model": PATH, ...}``).

The draft is a second, usually smaller, model with the target's vocabulary. It runs in the engine
that decodes (the decode worker when disaggregated; never on a prefill worker, which emits only a
request's first token), on its own paged KV: its own block pool of as many blocks as the target's,
prefix caching off, full precision. Its proposals are greedy, so ``engine/rejection.py``'s rule
(a point-mass draft distribution) keeps the target's output distribution exact.

Per request the draft remembers the tokens whose K/V its cache holds (``_seen``). On each
``propose`` call:

1. The cache is cut back to the longest common prefix of ``_seen`` and the request's tokens now
   (rejected proposals, and anything else that changed, drop out; at least the last token is fed
   again so there is a row to sample from).
2. One batched forward feeds every request's missing tokens (its whole prompt the first time: the
   draft's prompt K/V is built where the draft runs, not transferred) and takes the argmax of each
   request's last row: the first proposal.
3. ``k - 1`` batched one-token forwards extend each request's proposal greedily; a request whose
   budget ``k`` is reached drops out of the batch.

A request the draft pool cannot hold gets no proposal this step (its draft K/V is freed). Requests
no longer running are forgotten with ``release``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.kv_tensors import allocate_kv_cache
from engine.loader import load_model_source, resolve_model
from engine.models.causal_lm import CausalLM
from kernels import AttentionMetadata, get_attention_backend
from kernels.linear import LinearKernel


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModel:
    """A draft model with its own paged KV; ``propose`` gives greedy proposals for many requests."""

    def __init__(self, path: str, target: ModelConfig, config: EngineConfig, num_blocks: int) -> None:
        source = load_model_source(resolve_model(path))
        self.model_config = source.config
        if source.config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model {path} has a vocabulary of {source.config.vocab_size} tokens, the target "
                f"{target.vocab_size}: speculative draft_model needs the target's tokenizer")
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        kernel = cast(LinearKernel, config.linear_kernel)
        self.model = CausalLM(source.config, config.torch_dtype, config.device, kernel)
        self.model.bf16_products = config.bf16_products  # the target's precision
        self.model.load_weights(source.iter_weights())
        self.kv_cache = allocate_kv_cache(source.config, num_blocks, self.block_size, config.torch_dtype,
                                          self.device)
        self.kv = KVCacheManager(num_blocks, self.block_size, enable_caching=False, hash_seed=0)
        self.backend = get_attention_backend(self.device, config.attention_backend, False)
        self._seen: dict[str, list[int]] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def release(self, keep: set[str]) -> None:
        """Free the draft K/V of every request not in ``keep``."""
        for request_id in [r for r in self._seen if r not in keep]:
            self.forget(request_id)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
        self.kv.free(request_id)

    def propose(self, wants: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Greedy proposals: for each ``(request_id, token_ids, k)``, ``k`` tokens to follow ``token_ids``."""
        rows: list[tuple[str, list[int], int, int]] = []  # id, tokens, k, tokens already in the cache
        for request_id, token_ids, k in wants:
            tokens = list(token_ids)
            cached = min(_common_prefix(self._seen.get(request_id, ()), tokens), len(tokens) - 1)
            self.kv.shrink(request_id, cached)
            if k < 1 or not self.kv.allocate(request_id, len(tokens) + k - 1):
                self.forget(request_id)
                continue
            rows.append((request_id, tokens, k, cached))
        if not rows:
            return {}
        drafts: dict[str, list[int]] = {}
        # the first forward: every request's tokens past its cached prefix
        feeds = [(tokens[cached:], cached) for _, tokens, _, cached in rows]
        nexts = self._forward([r[0] for r in rows], feeds)
        for (request_id, tokens, _, _), token in zip(rows, nexts, strict=True):
            drafts[request_id] = [token]
            self._seen[request_id] = list(tokens)
        step = 1
        while True:
            live = [(request_id, tokens) for request_id, tokens, k, _ in rows if k > step]
            if not live:
                break
            feeds = [([drafts[r][-1]], len(tokens) + step - 1) for r, tokens in live]
            nexts = self._forward([r for r, _ in live], feeds)
            for (request_id, _), token in zip(live, nexts, strict=True):
                self._seen[request_id].append(drafts[request_id][-1])
                drafts[request_id].append(token)
            step += 1
        return drafts

    @torch.inference_mode()
    def _forward(self, request_ids: list[str], feeds: list[tuple[list[int], int]]) -> list[int]:
        """Write the K/V of each ``(tokens, start position)`` and return the argmax after each one's last."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        for tokens, start in feeds:
            input_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            last_rows.append(len(input_ids) - 1)
        tables = [self.kv.blocks_of(r) for r in request_ids]
        meta = AttentionMetadata.build(self.block_size, query_lens, seq_lens, tables, self.device)
        self.backend.prepare(meta)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                            torch.tensor(positions, dtype=torch.int64, device=self.device),
                            self.kv_cache, self.backend, meta)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
