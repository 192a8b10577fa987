"""Runs the model for one scheduled step: builds inputs and attention metadata, returns logits."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.model import CausalLM, allocate_kv_cache, allocate_kv_scales
from engine.scheduler import SchedulerOutput
from kernels import AttentionMetadata, get_attention_backend


class ModelRunner:
    def __init__(self, model: CausalLM, model_config: ModelConfig, engine_config: EngineConfig,
                 num_blocks: int) -> None:
        self.model = model
        self.model_config = model_config
        self.config = engine_config
        self.device = torch.device(engine_config.device)
        self.kv_cache = allocate_kv_cache(model_config, num_blocks, engine_config.block_size,
                                          engine_config.kv_torch_dtype, self.device)
        # per-block scales of a quantized (fp8/int8) cache; None when the cache is full precision
        self.kv_scales = (allocate_kv_scales(model_config, num_blocks, self.device)
                          if engine_config.kv_quantized else None)
        self.backend = get_attention_backend(self.device, engine_config.attention_backend,
                                             engine_config.kv_quantized)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache, scales included."""
        total = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.kv_scales is not None:
            total += self.kv_scales.numel() * self.kv_scales.element_size()
        return total

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Run every scheduled chunk; logits ``[num_completing, vocab]`` in scheduling order."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for item in out.scheduled:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            tokens = request.prompt_token_ids + request.output_token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end - request.kv_dropped_tokens)  # positions stay absolute; the cache does not
            tables.append(kv.blocks_of(request.request_id))
            if item.completes:
                sample_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(self.config.block_size, query_lens, seq_lens, tables, self.device)
        self.backend.prepare(meta)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache,
            self.backend,
            meta,
            self.kv_scales,
        )
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
