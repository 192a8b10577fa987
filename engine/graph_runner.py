"""Pure-decode steps through padded static buffers, captured as one CUDA graph per bucket.

``ModelRunner.execute`` offers every step of a single-rank engine to ``DecodeGraphRunner.execute``
first; ``None`` back means "not this one" (a step with a prefill chunk or proposed tokens, more
sequences than the largest bucket, a block table wider than the static one) and the step runs
eagerly, unpadded, as always. The runner exists in two modes (``graph_mode``):

* ``capture``: CUDA, ``enforce_eager`` off, one rank, and an attention backend that can be
  captured (``kernels.attention.CapturableBackend``: Triton and flashinfer). The torch
  reference plans from host lists, so with it graphs are off, logged once, and steps run
  eagerly.
* ``padded``: ``pad_decode_steps`` (any device, any backend, no capture): the same padding,
  buffers and per-bucket backend planning, with the forward run eagerly where a graph would
  replay. This is how the CPU tests check everything around the capture itself.

Per bucket (``engine/buckets.py``), lazily, on the first step that needs it (a bucket no batch
reaches costs nothing; the first step of each bucket pays for its capture):

1. the static buffers (``engine/cuda_graphs.py:DecodeGraphs``) are filled with pad rows only, so
   warm-up and capture write into the scratch block and nowhere else;
2. a backend instance of the bucket's own (``capture_instance``) is planned once for those
   buffers (``prepare_capture``) and kept: a graph replays the addresses of its arrays (a
   backend that cannot be captured, padded mode only, is the runner's own, planned every step);
3. one forward on the pad rows (padded mode); in capture mode, ``WARMUP_RUNS`` forwards on a
   side stream (Triton compiles, cuBLAS chooses its kernels), then one forward captured into a
   ``torch.cuda.CUDAGraph`` whose memory pool every bucket shares (graphs never run
   concurrently); its output tensor is kept. A capture that fails turns graphs off for the
   engine's life (logged) and the step runs eagerly.

Each step then copies its rows into the buffers (pad rows after them), lets the bucket's
backend do its host-side planning (``prepare_replay``: flashinfer's ``plan``; nothing for
Triton), replays the bucket's graph (or runs the same forward on the same buffers), and sends
the real rows' hidden states to the LM head outside the graph, so only the rows the step
samples are computed. The real rows' outputs agree with the unpadded step to float rounding
(the GEMMs see more rows, ``engine/cuda_graphs.py``); pad rows read and write only the
scratch block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, PaddedDecode
from engine.models.causal_lm import CausalLM
from engine.tp_group import StepPlan
from kernels.attention import AttentionBackend, CapturableBackend

logger = logging.getLogger(__name__)

GraphMode = Literal["capture", "padded"]
WARMUP_RUNS = 2


def graph_mode(config: EngineConfig, backend: AttentionBackend,
               host_synced: bool = False) -> GraphMode | None:
    """How pure-decode steps run: captured graphs, padded eagerly, or (None) unpadded as any step.
    ``host_synced``: the model's forward reads device values on the host (``CausalLM.host_synced``), which
    no graph can capture."""
    if config.tensor_parallel_size > 1:  # the collectives (gloo) cannot be captured
        return None
    if torch.device(config.device).type == "cuda" and not config.enforce_eager:
        if host_synced:
            logger.warning("CUDA graphs are off: the experts kept as quantized records run one expert's "
                           "products at a time, routed on the host; decode steps run eagerly")
        elif isinstance(backend, CapturableBackend):
            return "capture"
        else:
            logger.warning("CUDA graphs are off: %s cannot be captured; decode steps run eagerly "
                           "(the triton and flashinfer backends are captured)", type(backend).__name__)
    return "padded" if config.pad_decode_steps else None


@dataclass
class _Bucket:
    backend: AttentionBackend  # its own instance when capturable, planned once (prepare_capture)
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # the graph's hidden states [bucket, hidden]


class DecodeGraphRunner:
    """Runs pure-decode steps padded to buckets, replaying one CUDA graph per bucket in ``capture`` mode."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                 config: EngineConfig, mode: GraphMode, max_blocks_per_seq: int,
                 backend: AttentionBackend) -> None:
        self.model = model
        self.backend = backend  # the runner's: the buckets' instances come from it
        self.kv_cache = kv_cache  # all blocks, the scratch block (the last one) included
        self.kv_scales = kv_scales
        self.config = config
        self.mode: GraphMode | None = mode  # None once a capture failed without pad_decode_steps
        self.device = torch.device(config.device)
        self.buffers = DecodeGraphs(config.max_num_seqs, max_blocks_per_seq, config.block_size,
                                    scratch_block=kv_cache.shape[1] - 1, device=self.device)
        self.buckets: dict[int, _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        self.last: PaddedDecode | None = None  # the last step run here (the tests read its buffers)

    def handles(self, plan: StepPlan) -> int | None:
        """The bucket a step pads to, or None when it is not a pure-decode step that fits one."""
        if not plan.query_lens or any(q != 1 for q in plan.query_lens):
            return None
        if any(len(t) > self.buffers.block_tables.shape[1] for t in plan.tables):
            return None
        return self.buffers.bucket_for(len(plan.query_lens))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """The final hidden rows to sample (as ``ModelRunner.run``; a view of this bucket's buffers when
        they are the first rows), or None: run it eagerly instead."""
        bucket = self.handles(plan) if self.mode is not None else None
        if bucket is None:
            return None
        entry = self.buckets.get(bucket) or self._setup(bucket)
        if entry is None:
            return None
        padded = self.buffers.pad(plan.input_ids, plan.positions, plan.seq_lens, plan.tables)
        assert padded is not None and padded.bucket == bucket
        self.last = padded
        if isinstance(entry.backend, CapturableBackend):
            entry.backend.prepare_replay(padded.meta)
        else:
            entry.backend.prepare(padded.meta)
        if entry.graph is not None and entry.output is not None:
            entry.graph.replay()
            hidden = entry.output
        else:
            hidden = self._forward(entry.backend, padded)
        n = padded.num_real
        if plan.sample_rows == list(range(n)):
            return hidden[:n]
        rows = torch.tensor(plan.sample_rows, dtype=torch.int64, device=self.device)
        return hidden.index_select(0, rows)

    def _forward(self, backend: AttentionBackend, padded: PaddedDecode) -> torch.Tensor:
        return self.model(padded.input_ids, padded.positions, self.kv_cache, backend, padded.meta,
                          self.kv_scales)

    def _setup(self, bucket: int) -> _Bucket | None:
        """Plan (and in ``capture`` mode capture) ``bucket`` on pad rows only."""
        dummy = self.buffers.pad_only(bucket)
        backend = self.backend
        if isinstance(backend, CapturableBackend):
            backend = backend.capture_instance()
            backend.prepare_capture(dummy.meta)
        entry = _Bucket(backend)
        if self.mode == "padded":  # the warm-up a capture runs, so it is checked here too
            if not isinstance(backend, CapturableBackend):
                backend.prepare(dummy.meta)
            self._forward(backend, dummy)
        else:
            try:
                entry.graph, entry.output = self._capture(backend, dummy)
            except RuntimeError:
                logger.exception("capturing the decode graph of bucket %d failed; CUDA graphs are off, "
                                 "decode steps run eagerly", bucket)
                self.mode = "padded" if self.config.pad_decode_steps else None
                self.buckets.clear()
                return self._setup(bucket) if self.mode is not None else None
        self.buckets[bucket] = entry
        return entry

    def _capture(self, backend: AttentionBackend,
                 dummy: PaddedDecode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._forward(backend, dummy)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (KV transfers, offload) may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = self._forward(backend, dummy)
        return graph, output
