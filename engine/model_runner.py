"""Runs the model for one scheduled step: builds inputs and attention metadata, returns the rows to sample.

A step's result is a ``StepRows``: the final hidden rows to sample, with the LM head applied on demand,
so a step whose rows are all plain greedy can take ``greedy_ids`` (``CausalLM.greedy_tokens``) and never
compute the whole ``[rows, vocab]`` logits. With tensor parallelism the logits are computed in the step
itself (every rank takes part in their gather).

With tensor parallelism the runner on rank 0 turns each step into a ``StepPlan`` and sends it to the
other ranks before its own forward (``engine/tp_group.py``); ``follow`` is the other ranks' loop: the
same ``inputs`` and ``run`` on their shard, their KV cache using rank 0's block ids.

On one rank, ``execute`` offers each step to ``engine/graph_runner.py`` first (CUDA graphs for
pure-decode steps, or the same padding without capture under ``pad_decode_steps``; a model of one KV
group only); what it declines runs here.

KV groups (``engine/kv_groups.py``): the cache holds ``slots`` layers per block; each group has its own
block tables, attention metadata and backend instance (prepared once per step), and layer ``l`` reads
``kv_cache[slot_of[l]]`` through its group's. A sliding group's ``NULL_BLOCK`` entries reach the
kernels as block 0: its window masks them, so they are never read for a value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine.config import EngineConfig, ModelConfig
from engine.graph_runner import DecodeGraphRunner, graph_mode
from engine.kv_cache import KVCacheManager
from engine.kv_groups import NULL_BLOCK, KvGroup, kv_layout, num_slots
from engine.kv_tensors import allocate_kv_cache, allocate_kv_scales
from engine.models.causal_lm import CausalLM
from engine.scheduler import SchedulerOutput
from engine.tp_group import Call, CallReply, StepPlan, Stop, TpGroup, run_handler
from kernels import AttentionBackend, AttentionMetadata, TorchAttentionBackend, get_attention_backend
from kernels.cpu_native import NativeCpuAttentionBackend, native_available
from kernels.mla_backends import mla_backend

if TYPE_CHECKING:
    from engine.compiled import CompiledDecoder


class StepRows:
    """The final hidden rows of a step's tokens to sample, in the order ``execute`` documents.

    ``logits()`` is ``CausalLM.compute_logits`` over them (``[rows, vocab]`` float32, computed once);
    ``greedy_ids()`` each row's argmax of those logits, bitwise, computed without them where the model's
    greedy head applies, else None. Read them before the next step: a padded decode step's rows are
    a view of buffers the next one overwrites (``engine/graph_runner.py``).
    """

    def __init__(self, model: CausalLM, hidden: torch.Tensor | None, logits: torch.Tensor | None = None
                 ) -> None:
        if hidden is None and logits is None:
            raise ValueError("StepRows needs the hidden rows or their logits")
        self.model = model
        self.hidden = hidden
        self._logits = logits

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            assert self.hidden is not None
            with torch.inference_mode():
                self._logits = self.model.compute_logits(self.hidden)
        return self._logits

    def greedy_ids(self) -> list[int] | None:
        if self._logits is not None or self.hidden is None:
            return None
        with torch.inference_mode():
            ids = self.model.greedy_tokens(self.hidden)
        return None if ids is None else ids.tolist()


@dataclass
class StepInputs:
    """One step's model inputs: flat token ids and positions, attention metadata, rows to sample."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    group_metas: list[AttentionMetadata] | None = None  # every group's (meta first) of a hybrid model


class ModelRunner:
    def __init__(self, model: CausalLM, model_config: ModelConfig, engine_config: EngineConfig,
                 num_blocks: int, groups: tuple[KvGroup, ...] | None = None) -> None:
        self.model = model
        self.model_config = model_config
        self.config = engine_config
        self.group: TpGroup | None = model.group
        self.device = torch.device(engine_config.device)
        kv_config = model.shard.kv_config  # this rank's KV heads
        self.kv_groups = groups or kv_layout(model_config, engine_config.hybrid_kv)
        self.slots = num_slots(self.kv_groups)
        model.set_kv_groups(self.kv_groups)
        # --kv-eviction: the attention mass each block received per layer and KV head (engine/kv_eviction.py),
        # [blocks, layers x kv_heads]; the scratch block of padded steps included
        self.kv_mass = (torch.zeros(num_blocks + 1, model_config.num_layers * kv_config.num_kv_heads,
                                    dtype=torch.float32, device=self.device)
                        if engine_config.kv_eviction != "none" else None)
        self.backends = [self._new_backend() for _ in self.kv_groups]
        self.backend = self.backends[0]
        # the block pool's size; padded decode steps (engine/graph_runner.py) add one block past it, the
        # scratch block their pad rows write, which no request ever holds
        self.num_blocks = num_blocks
        graphs = (graph_mode(engine_config, self.backend, model.host_synced) if len(self.kv_groups) == 1
                  else None)
        allocated = num_blocks + (1 if graphs else 0)
        self.kv_cache = allocate_kv_cache(kv_config, allocated, engine_config.block_size,
                                          engine_config.kv_torch_dtype, self.device, self.slots)
        # per-block scales of a quantized (fp8/int8/int4) cache; None when the cache is full precision
        self.kv_scales = (allocate_kv_scales(kv_config, allocated, self.device, self.slots,
                                             engine_config.kv_torch_dtype)
                          if engine_config.kv_quantized else None)
        self.decode_graphs = (DecodeGraphRunner(model, self.kv_cache, self.kv_scales, engine_config, graphs,
                                                self._table_width(), self.backend) if graphs else None)
        self._compiled: CompiledDecoder | None = None
        self.compiled: CompiledDecoder | None = None
        self.set_compiled(engine_config.compile_enabled and self.kv_mass is None)

    def _new_backend(self) -> AttentionBackend:
        """A KV group's attention backend: MLA's (``kernels/mla.py``) for a latent cache."""
        name = self.config.attention_backend
        if self.model_config.mla is not None:
            return cast(AttentionBackend, mla_backend(self.device, name, self.config.native_kernels,
                                                      self.config.torch_dtype))
        if self.kv_mass is not None:  # the native CPU kernels and the torch one score blocks
            if (name == "auto" and self.device.type == "cpu" and self.config.native_kernels
                    and native_available()):
                return NativeCpuAttentionBackend(mass=self.kv_mass)
            return TorchAttentionBackend(mass=self.kv_mass)
        if name == "auto" and self.device.type == "cpu" and not self.config.native_kernels:
            name = "torch"
        return get_attention_backend(self.device, name, self.config.kv_quantized)

    def _table_width(self) -> int:
        """Blocks a sequence can hold: the static block tables' width."""
        limit = self.config.max_model_len or self.model_config.max_position_embeddings
        return -(-min(limit, self.num_blocks * self.config.block_size) // self.config.block_size)

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

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> StepRows:
        """Run every scheduled chunk; the rows to sample in scheduling order, one per completing chunk
        plus one per proposed token it verifies (``ScheduledRequest.spec_token_ids``)."""
        plan = self.plan(out, kv)
        if self.group is None:
            if self.decode_graphs is not None:  # pure-decode steps padded to a bucket, replayed
                rows = self.decode_graphs.execute(plan)
                if rows is not None:
                    return StepRows(self.model, rows)
            return self.run(self.inputs(plan))
        with self.group.lock:  # the plan and this forward's collectives, never interleaved with a keep-alive
            self.group.send_plan(plan)
            return self.run(self.inputs(plan))

    def follow(self, handlers: Mapping[str, Callable[[bytes], bytes]] | None = None) -> None:
        """Ranks 1..N-1: run every step rank 0 plans, and every ``Call`` by its handler (an unknown name
        answers an error), until rank 0 sends ``Stop`` (raises ``TpError`` when the group breaks)."""
        assert self.group is not None and self.group.rank > 0
        handlers = handlers or {}
        while True:
            plan = self.group.recv_plan()
            if isinstance(plan, Stop):
                return
            if isinstance(plan, Call):
                handler = handlers.get(plan.name)
                payload = plan.payload
                reply = (run_handler(lambda: handler(payload)) if handler is not None  # noqa: B023
                         else CallReply(error=f"rank {self.group.rank} has no handler {plan.name!r}"))
                self.group.gather_replies(reply)
            elif isinstance(plan, StepPlan):
                self.run(self.inputs(plan))

    def prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> StepInputs:
        """Flatten the scheduled chunks into tensors and attention metadata."""
        return self.inputs(self.plan(out, kv))

    def plan(self, out: SchedulerOutput, kv: KVCacheManager) -> StepPlan:
        """Flatten the scheduled chunks into the step's plan (plain lists)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        others: list[list[list[int]]] = [[] for _ in self.kv_groups[1:]]
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
            group_tables = kv.tables_of(request.request_id)
            if len(group_tables) > 1 or NULL_BLOCK in group_tables[0]:  # the kernels read block 0 there
                group_tables = [[max(b, 0) for b in t] for t in group_tables]
            tables.append(group_tables[0])
            for mine, table in zip(others, group_tables[1:], strict=True):
                mine.append(table)
            if item.completes:  # the last known token's row, then one per proposed token
                sample_rows.extend(range(len(input_ids) - 1 - len(item.spec_token_ids), len(input_ids)))
        return StepPlan(input_ids, positions, query_lens, seq_lens, tables, sample_rows, others)

    def inputs(self, plan: StepPlan) -> StepInputs:
        """The plan as tensors and attention metadata (each group's backend prepared for it)."""
        metas = [AttentionMetadata.build(self.config.block_size, plan.query_lens, plan.seq_lens, tables,
                                         self.device) for tables in [plan.tables, *plan.group_tables]]
        for backend, meta in zip(self.backends, metas, strict=True):
            backend.prepare(meta)
        return StepInputs(torch.tensor(plan.input_ids, dtype=torch.int64, device=self.device),
                          torch.tensor(plan.positions, dtype=torch.int64, device=self.device), metas[0],
                          torch.tensor(plan.sample_rows, dtype=torch.int64, device=self.device),
                          metas if len(metas) > 1 else None)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> StepRows:
        """The forward pass; the rows to sample (their logits too with tensor parallelism)."""
        if self.compiled is not None and self.compiled.handles(inputs.meta):
            hidden = self.compiled.forward(inputs.input_ids, inputs.positions, self.kv_cache, self.backend,
                                           self.kv_scales)
        else:
            backends = self.backends if inputs.group_metas is not None else self.backend
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, backends, inputs.meta,
                                self.kv_scales)
        rows = hidden.index_select(0, inputs.sample_rows)
        if self.group is not None:  # every rank computes its logits' share now, for the gather
            return StepRows(self.model, None, self.model.compute_logits(rows))
        return StepRows(self.model, rows)
