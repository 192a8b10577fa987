"""LLMEngine: one model on one device, stepping schedule -> run -> postprocess.

Disaggregation hooks (used by ``prefill/`` and ``decode/``; colocated use needs none):
``add_request(..., hold_kv=True)`` keeps a finished request's blocks, owned by ``request_id``, until
``release_kv(request_id)`` (a prefill worker's lease); the rest of the handoff (``reserve``,
``start_prefilled``, ...) is ``engine/handoff.py``'s ``KvHandoff``, which the engine inherits.

Tensor parallelism: with ``tensor_parallel_size`` N the engine is rank 0 of a ``TpGroup`` whose other
ranks run ``ModelRunner.follow`` (``engine/tp_ranks.py`` starts them for ``LLM``). Rank 0 alone
schedules, owns the one block pool (its block ids index every rank's KV shard) and samples; the pool's
size is the smallest any rank's budget buys (``engine/runner_build.py``).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.draft import DraftModel
from engine.handoff import KvHandoff
from engine.hashing import seed_for
from engine.kv_cache import KVCacheManager
from engine.kv_eviction import KvEviction
from engine.kv_groups import max_sequence_tokens
from engine.kv_sizing import KvTier, kv_block_bytes
from engine.loader import ModelSource, load_model_source, resolve_model
from engine.model_runner import StepRows
from engine.offload import KvOffload
from engine.outputs import RequestOutput
from engine.rejection import Verified, verify
from engine.request import Request
from engine.runner_build import build_runner
from engine.sampling import Sampler, SamplerOutput, SamplingParams, plain_greedy
from engine.scheduler import KvWindow, ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec_decode import SpecDecoder, SpecStats
from engine.step_work import StepWork, step_work
from engine.structured import Grammars, apply_logit_bias
from engine.swap import HostSwapSpace
from engine.tokenizer import Tokenizer
from engine.tp_group import TpGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int = 0  # device KV capacity: codes plus the scales of a quantized cache
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    swap_used_bytes: int = 0
    kv_offload_host_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_host_hits: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_stores: int = 0
    kv_offload_host_bytes: int = 0
    kv_offload_disk_bytes: int = 0
    kv_tiers: tuple[KvTier, ...] = ()  # device, then host / disk when configured
    spec: SpecStats | None = None  # speculative decoding totals when it is on
    kv_evicted_tokens: int = 0  # --kv-eviction: tokens freed since start (engine/kv_eviction.py)


def _greedy_only(item: ScheduledRequest) -> bool:
    """Whether this chunk's next token is the plain argmax of the model's logits."""
    request = item.request
    return (not item.spec_token_ids and request.guide is None and request.params.structured is None
            and not request.params.logit_bias and plain_greedy(request.sampling))


class LLMEngine(KvHandoff):
    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 check_integrity: bool = False, group: TpGroup | None = None) -> None:
        self.config = config or EngineConfig()
        self.source: ModelSource = load_model_source(resolve_model(model))
        self.model_config = self.source.config
        self.tokenizer: Tokenizer = self.source.load_tokenizer()
        self.runner = build_runner(self.source, self.config, group)
        self.config = self.runner.config  # --dtype auto resolved for the model (EngineConfig.resolve_auto)
        blocks = self.runner.num_blocks  # the KV cache may hold one more: the scratch block
        self.kv = KVCacheManager(blocks, self.config.block_size, self.config.enable_prefix_caching,
                                 hash_seed=seed_for(self.model_config.name), groups=self.runner.kv_groups)
        self.kv_window: KvWindow | None = None
        if self.config.kv_window is not None:  # a model's own sliding layers mask exactly, in the kernels
            if self.model_config.has_sliding_layers:
                raise ValueError(f"--kv-window does not combine with {self.model_config.name}'s own "
                                 f"sliding-window layers ({self.model_config.architecture}); leave it out")
            sink_blocks = -(-self.config.kv_sinks // self.config.block_size)
            self.kv_window = KvWindow(sink_blocks, self.config.kv_window)
        if self.config.kv_window is not None or self.config.kv_eviction != "none":
            # bounded KV: generation length is not bounded by the pool
            self.max_model_len = self.config.max_model_len or sys.maxsize
        else:
            limit = self.config.max_model_len or self.model_config.max_position_embeddings
            held = max_sequence_tokens(self.kv.groups, blocks, self.config.block_size)
            self.max_model_len = min(limit, held)
        if self.kv.hybrid:
            self._refuse_with_hybrid_kv()
        self.offload: KvOffload | None = None
        if self.config.enable_prefix_caching and (self.config.kv_offload_bytes or self.config.kv_offload_dir):
            self.offload = KvOffload(
                self.runner.kv_cache, self.runner.kv_scales, self.config.kv_offload_bytes,
                self.config.kv_offload_dir, self.config.kv_offload_disk_bytes,
                compat={"model": self.model_config.name, "hash_seed": self.kv.hash_seed,
                        "block_size": self.config.block_size})
            self.kv.offload = self.offload
            self.kv.pool.on_evict = self.offload.store
        self.swap = (HostSwapSpace(self.runner.kv_cache, self.runner.kv_scales, self.config.swap_space)
                     if self.config.preemption_mode == "swap" else None)
        self.eviction = KvEviction.for_engine(self.config, self.model_config, self.runner.kv_mass)
        self.scheduler = Scheduler(self.kv, self.config.max_num_batched_tokens,
                                   self.config.max_num_seqs, self.max_model_len,
                                   self.config.preemption_mode, self.swap, self.kv_window,
                                   self.config.prefix_wait_min_tokens, eviction=self.eviction)
        self.sampler = Sampler()
        spec = self.config.speculative
        draft = (DraftModel(spec.model, self.model_config, self.config, blocks)
                 if spec is not None and spec.method == "draft_model" and spec.model else None)
        self.spec = SpecDecoder(spec, self.kv, self.max_model_len, draft) if spec is not None else None
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) or self.model_config.eos_token_ids
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        # what the last step computed (``engine/step_work.py``); None when it scheduled nothing
        self.last_step_work: StepWork | None = None
        self.reserved: dict[str, Request] = {}
        self.check_integrity = check_integrity
        self._ids = itertools.count()

    def _refuse_with_hybrid_kv(self) -> None:
        """Name the options that do not yet keep a hybrid model's KV groups (``engine/kv_groups.py``)."""
        unsupported = {"--kv-offload-bytes / --kv-offload-dir": bool(self.config.kv_offload_bytes
                                                                     or self.config.kv_offload_dir),
                       "--preemption-mode swap": self.config.preemption_mode == "swap"}
        named = [flag for flag, on in unsupported.items() if on]
        if named:
            raise ValueError(f"{', '.join(named)} does not combine with the hybrid KV groups of "
                             f"{self.model_config.name} ({self.model_config.architecture}) yet; leave it out "
                             f"or turn the hybrid KV manager off (--no-hybrid-kv)")

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     arrival_time: float | None = None, hold_kv: bool = False) -> Request:
        """Validate and build a request without queueing it."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("the engine runs n=1 per request; submit n requests instead")
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room under max_model_len {self.max_model_len}"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, self.eos_token_ids, text,
                          arrival_time or time.monotonic(), priority, hold_kv)
        so = params.structured
        if so is not None:  # compiles here unless cached: workers await ``grammars.prepare`` first
            if so.resumed_tokens >= len(token_ids):
                raise ValueError("structured.resumed_tokens must be fewer than the prompt's tokens")
            request.guide = self.grammars.guide(so, token_ids[len(token_ids) - so.resumed_tokens:])
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, hold_kv: bool = False) -> Request:
        request = self.make_request(prompt, params, request_id, priority, arrival_time, hold_kv)
        self.scheduler.add(request)
        self.requests[request.request_id] = request
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is (queued, running, reserved) and free its blocks."""
        request = self.requests.pop(request_id, None) or self.reserved.pop(request_id, None)
        if request is None:
            self.kv.free(request_id)
            return None
        request.abort()
        self.scheduler.finish(request)
        if self.spec is not None:
            self.spec.forget(request_id)
        return self._output(request, [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample; outputs for requests that got a token or finished."""
        drafts = self.spec.propose(self.scheduler.running) if self.spec is not None else None
        out = self.scheduler.schedule(drafts)
        if not out:
            self.last_step_work = None
            return []
        self.last_step_work = step_work(out)
        return self.process(out, self.sample(out, self.runner.execute(out, self.kv)))

    def sample(self, out: SchedulerOutput, rows: StepRows) -> SamplerOutput | Verified | None:
        """One token per completing chunk of ``out`` (None when no chunk completes); with proposed
        tokens in the step, 1 to 1 + proposals per chunk (``engine/rejection.py``). Logit bias and
        grammar masks apply to every row; a constrained request never has proposals
        (``SpecDecoder.propose``), so its one row is masked by its guide's current state. A step whose
        rows are all plain greedy (no bias, grammar, penalties, logprobs, banned ids or proposals) takes
        the model's greedy head when it applies (``StepRows.greedy_ids``): the same tokens, bitwise."""
        completing = [item for item in out.scheduled if item.completes]
        if not completing:
            return None
        if all(_greedy_only(item) for item in completing):
            ids = rows.greedy_ids()
            if ids is not None:
                return SamplerOutput(ids, [None] * len(ids))
        logits = rows.logits()
        counts = [1 + len(item.spec_token_ids) for item in completing]
        params = [item.request.params for item, n in zip(completing, counts, strict=True) for _ in range(n)]
        guides = [item.request.guide for item, n in zip(completing, counts, strict=True) for _ in range(n)]
        logits = apply_logit_bias(logits, params)
        logits = self.grammars.apply(logits, guides)
        states = [item.request.sampling for item in completing]
        if any(item.spec_token_ids for item in completing):
            return verify(self.sampler, logits, states, [item.spec_token_ids for item in completing])
        return self.sampler.sample(logits, states)

    def process(self, out: SchedulerOutput, sampled: SamplerOutput | Verified | None) -> list[RequestOutput]:
        """Advance the scheduler and the requests past a step; the outputs to hand back."""
        completing = [item.request for item in out.scheduled if item.completes]
        if isinstance(sampled, Verified) and self.spec is not None:
            self.spec.settle(out, sampled)
        self.scheduler.update_after_step(out)
        outputs = []
        if isinstance(sampled, SamplerOutput):
            sampled = Verified([[t] for t in sampled.token_ids], [[lp] for lp in sampled.logprobs])
        if sampled is not None:
            for request, token_ids, lps in zip(completing, sampled.token_ids, sampled.logprobs, strict=True):
                new: list[int] = []
                for token_id, lp in zip(token_ids, lps, strict=True):
                    request.append_token(token_id, lp, self.max_model_len)
                    new.append(token_id)
                    if request.is_finished:
                        break
                if len(token_ids) > 1:  # blocks the accepted proposals filled, before a finish frees them
                    self.kv.cache_blocks(request.request_id, request.all_token_ids,
                                         request.num_computed_tokens)
                if request.is_finished:
                    self.scheduler.finish(request, free_kv=not request.hold_kv)
                    del self.requests[request.request_id]
                    if self.spec is not None:
                        self.spec.forget(request.request_id)
                outputs.append(self._output(request, new))
        if self.check_integrity:
            self.kv.check_integrity()
        return outputs

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finished = request.is_finished
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            finished=finished,
            finish_reason=request.finish_reason,
            metrics=request.metrics,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            stop_token_id=request.stop_token_id,
            new_token_ids=new_token_ids,
            detokenize=self.tokenizer.decode,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.kv.num_blocks,
            num_free_kv_blocks=self.kv.num_free_blocks,
            kv_usage=self.kv.usage,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache_dtype=("int4" if self.runner.kv_cache.dtype == torch.uint8  # kernels/kv_int4.py
                            else str(self.runner.kv_cache.dtype).removeprefix("torch.")),
            kv_cache_bytes=self.runner.kv_cache_bytes,
            num_swap_outs=self.swap.num_swap_outs if self.swap else 0,
            num_swap_ins=self.swap.num_swap_ins if self.swap else 0,
            swap_used_bytes=self.swap.used_bytes if self.swap else 0,
            **self._offload_stats(),
            kv_tiers=self.kv_tiers(),
            spec=self.spec.stats if self.spec is not None else None,
            kv_evicted_tokens=self.eviction.evicted_tokens if self.eviction is not None else 0,
        )

    def kv_tiers(self) -> tuple[KvTier, ...]:
        """Capacity and use per KV tier: the device cache, then the host and disk offload tiers when
        configured (a tier holding no whole block is left out)."""
        shard = self.runner.model.shard.kv_config  # one rank's bytes per block
        block = kv_block_bytes(shard, self.config.block_size, self.config.kv_torch_dtype)
        tiers = [KvTier("device", self.kv.num_blocks, self.kv.pool.num_used_blocks, block)]
        if self.offload is not None:
            off, t = self.offload, self.offload.stats
            if off.host_capacity_blocks:
                tiers.append(KvTier("host", off.host_capacity_blocks, t.host_blocks, block, t.host_hits))
            if off.disk_capacity_blocks:
                tiers.append(KvTier("disk", off.disk_capacity_blocks, t.disk_blocks, block, t.disk_hits))
        return tuple(tiers)

    def _offload_stats(self) -> dict[str, int]:
        if self.offload is None:
            return {}
        t = self.offload.stats
        return {"kv_offload_host_blocks": t.host_blocks, "kv_offload_disk_blocks": t.disk_blocks,
                "kv_offload_host_hits": t.host_hits, "kv_offload_disk_hits": t.disk_hits,
                "kv_offload_stores": t.stores, "kv_offload_host_bytes": t.host_bytes,
                "kv_offload_disk_bytes": t.disk_bytes}

    # What a serving worker (worker/, prefill/, decode/) asks of its engine, so it reaches into no part.

    def reset_prefix_cache(self) -> int:
        """Forget every idle block of the prefix cache (a drained worker's last act); how many went."""
        return self.kv.pool.reset_prefix_cache()

    def decodes_only_next(self) -> bool:
        """Whether the next step can only be a decode step: nothing waits and every running request has
        computed all its tokens but the last one."""
        s = self.scheduler
        return not s.waiting and all(r.num_computed_tokens >= r.num_tokens - 1 for r in s.running)

    def longest_prompt_left(self) -> int:
        """The most tokens any request still has to compute before its next one is sampled (a waiting
        request counts whole: a prefix-cache hit is known only when it is scheduled)."""
        s = self.scheduler
        return max((r.num_tokens - r.num_computed_tokens for r in itertools.chain(s.waiting, s.running)),
                   default=0)

    def prompts_thread_invariant(self) -> bool:
        """Whether this engine's prompt chunks give bitwise the same K/V and tokens on any thread count,
        as its decode-only steps always do: on CPU, products in the native library (``--linear-kernel
        native``, each output computed by one thread in one order), the native attention kernels, and a
        dense decoder (no experts, no latent attention, whose products are torch's). Shared cores
        (``worker/core_share.py``) lend threads to such prompt chunks."""
        from kernels.cpu_native import NativeCpuAttentionBackend

        m = self.model_config
        native = all(isinstance(b, NativeCpuAttentionBackend) for b in self.runner.backends)
        return (self.config.device == "cpu" and self.config.linear_kernel == "native" and m.moe is None
                and m.mla is None and native)

    def num_held(self) -> int:
        """Requests, reservations and KV blocks this engine still holds (0: nothing to finish or free)."""
        return len(self.requests) + len(self.reserved) + self.kv.pool.num_used_blocks

    def num_used_blocks(self) -> int:
        """KV blocks held by requests (running, reserved, or kept with ``hold_kv``)."""
        return self.kv.pool.num_used_blocks

    def num_cached_blocks(self) -> int:
        """KV blocks the prefix cache can hand out again (in use or idle)."""
        return len(self.kv.pool.cached)
