"""Runs the model for one scheduled step: builds inputs and attention metadata, returns logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCacheManager
from engine.model import CausalLM, allocate_kv_cache, allocate_kv_scales
from engine.scheduler import SchedulerOutput
from kernels import AttentionMetadata, get_attention_backend

if TYPE_CHECKING:
    from engine.compiled import CompiledDecoder


@dataclass
class StepInputs:
    """One step's model inputs: flat token ids and positions, attention metadata, rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor


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
        self._compiled: CompiledDecoder | None = None
        self.compiled: CompiledDecoder | None = None
        self.set_compiled(engine_config.compile_enabled)

    def set_compiled(self, on: bool) -> None:
        """Run decode steps through the compiled decoder (``engine/compiled.py``) or eagerly."""
        if on and self._compiled is None:
            from engine.compiled import CompiledDecoder  # torch.compile's imports only when asked for

            self._compiled = CompiledDecoder(self.model, self.config.max_num_seqs)
        self.compiled = self._compiled if on else None

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the device KV cache, scales included."""
        total = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.kv_scales is not None:
            total += self.kv_scales.numel() * self.kv_scales.element_size()
        return total

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Run every scheduled chunk; logits in scheduling order, one row per completing chunk plus one
        per proposed token it verifies (``ScheduledRequest.spec_token_ids``)."""
        return self.run(self.prepare(out, kv))

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        """Flatten the scheduled chunks into tensors and attention metadata."""
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
            tokens = request.prompt_token_ids + request.output_token_ids + item.spec_token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end - request.kv_dropped_tokens)  # positions stay absolute; the cache does not
            tables.append(kv.blocks_of(request.request_id))
            if item.completes:  # the last known token's row, then one per proposed token
                sample_rows.extend(range(len(input_ids) - 1 - len(item.spec_token_ids), len(input_ids)))
        meta = AttentionMetadata.build(self.config.block_size, query_lens, seq_lens, tables, self.device)
        self.backend.prepare(meta)
        return StepInputs(torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                          torch.tensor(positions, dtype=torch.int64, device=self.device), meta,
                          torch.tensor(sample_rows, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass and the LM head over the rows to sample."""
        if self.compiled is not None and self.compiled.handles(inputs.meta):
            hidden = self.compiled.forward(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                                           self.kv_scales)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, self.backend, inputs.meta,
                                self.kv_scales)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
