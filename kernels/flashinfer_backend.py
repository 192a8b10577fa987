"""``AttentionBackend`` on flashinfer's batch paged-prefill kernel (CUDA only).

Imported only when chosen (``kernels.get_attention_backend``), so CPU-only installs
never import flashinfer. Our per-layer KV tensor ``[blocks, 2, block_size, kv_heads,
head_dim]`` is flashinfer's NHD paged layout as is. ``prepare`` plans the page-table
arrays in plain Python (``kernels/flashinfer_plan.py``, decodes first) and copies them
to the device once per step; the wrapper's own ``plan`` runs at the first layer, when
the head counts and dtypes are known. One ``BatchPrefillWithPagedKVCacheWrapper`` with
``causal=True`` serves decodes and chunks alike (flashinfer aligns the causal mask to
the end of the KV, which is our "query i sits at ``L - q_len + i``").

Quantized caches are refused. flashinfer's fp8 path takes one scalar ``k_scale`` /
``v_scale`` per layer, while our fp8/int8 blocks carry one scale per block, per K/V,
per KV head (``kernels/kv_quant.py``) and are requantized as blocks fill; reading our
bytes with a single scale would be wrong, and converting them per step would cost
more than it saves. So with ``kv_cache_dtype`` fp8/int8, ``auto`` picks the Triton
backend on CUDA, and asking for flashinfer is an error at engine start. That is also
what keeps a disaggregated fp8 transfer correct: prefill and decode both write and
read the same per-block-scaled bytes (Triton and the torch reference agree on them
byte for byte, ``tests/unit/test_triton_attention.py``), whichever of those two each
role runs; flashinfer never sees them.

Per-layer features: a sliding window and a logit softcap are flashinfer's own plan parameters
(``kernels/flashinfer_plan.py:flashinfer_variant``), so each kind of layer (Gemma 3's local and
global layers, say) gets a wrapper of its own, sharing the float workspace (layers run one
after another on one stream) and planned once per step at its first layer. Attention sinks
are not given to flashinfer here (its paged prefill wrapper takes none on sm_80/sm_90): a
layer with sinks runs on this backend's Triton twin (``kernels/triton_backend.py``), planned
with every step alongside, which writes the layer's K/V and attends as the Triton backend
does. ``features`` names what flashinfer runs natively.

CUDA graphs (``kernels.attention.CapturableBackend``): each decode bucket gets an instance
of its own (``capture_instance``, sharing this one's workspace) whose wrappers are built with
``use_cuda_graph=True`` and fixed index buffers sized for the bucket, one per variant, at the
variant's first layer in the warm-up forward that precedes the capture. flashinfer's ``plan``
cannot be captured, so it runs before every replay, on the host (``prepare_replay``), for
every variant the warm-up met, and writes the step's page table into those buffers; the
captured ``run`` reads them. The K/V write rows come from the static slot mapping inside
``forward``. The Triton twin is planned for the bucket too (``prepare_capture``).

Not yet run on a GPU (README.md lists what has been).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.attention import AttentionMetadata
from kernels.flashinfer_plan import FlashInferPlan, LayerVariant, flashinfer_variant, plan_flashinfer
from kernels.kv_quant import is_quantized
from kernels.triton_backend import TritonAttentionBackend, check_features

WORKSPACE_BYTES = 128 * 1024**2


def write_rows(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Row of each slot's K in a layer viewed as ``[blocks * 2 * block_size, kv_heads, head_dim]`` (V is
    ``block_size`` rows further on); device ops only, so a captured forward recomputes them."""
    slots = slot_mapping.to(torch.int64)
    return torch.div(slots, block_size, rounding_mode="floor") * (2 * block_size) + slots % block_size


class FlashInferAttentionBackend:
    features: frozenset[str] = frozenset({"window", "softcap"})

    def __init__(self, device: torch.device | str = "cuda", workspace: torch.Tensor | None = None) -> None:
        import flashinfer

        self._flashinfer: Any = flashinfer
        self._device = torch.device(device)
        self._workspace = (workspace if workspace is not None else
                           torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self._device))
        self._wrappers: dict[LayerVariant, Any] = {}
        self._capture_shape: tuple[int, int] | None = None  # (sequences, table width) of a graph bucket
        self._static = False
        self._last_keys: dict[LayerVariant, tuple[Any, ...]] = {}  # what each wrapper was last planned for
        self._planned: dict[LayerVariant, tuple[Any, ...]] = {}  # ... in this step
        self._meta: AttentionMetadata | None = None
        self._plan: FlashInferPlan | None = None
        self._arrays: list[torch.Tensor] = []
        self._token_order: torch.Tensor | None = None
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._triton = TritonAttentionBackend()  # layers with sinks

    def prepare(self, meta: AttentionMetadata) -> None:
        plan = plan_flashinfer(meta)
        self._meta, self._plan, self._planned = meta, plan, {}
        arrays = [plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len]
        self._arrays = [torch.tensor(a, dtype=torch.int32).to(self._device, non_blocking=True)
                        for a in arrays]
        self._token_order = (None if plan.token_order is None else
                             torch.tensor(plan.token_order, dtype=torch.int64).to(self._device))
        self._write_rows = write_rows(meta.slot_mapping, meta.block_size)
        if not self._static:
            self._triton.prepare(meta)

    def capture_instance(self) -> FlashInferAttentionBackend:
        return FlashInferAttentionBackend(self._device, self._workspace)

    def prepare_capture(self, meta: AttentionMetadata) -> None:
        """Plan this instance for a pure-decode bucket; each variant gets its wrapper at its first layer."""
        if not meta.is_pure_decode:
            raise ValueError("prepare_capture takes pure-decode steps only (every query one token)")
        self._capture_shape = (meta.num_seqs, int(meta.block_tables.shape[1]))
        self._wrappers, self._last_keys = {}, {}
        self._triton.prepare_capture(meta)
        self._static = True
        self.prepare(meta)

    def prepare_replay(self, meta: AttentionMetadata) -> None:
        """Plan the step into every wrapper's fixed buffers, outside the graph (as the warm-up planned)."""
        self.prepare(meta)
        self._triton.prepare_replay(meta)
        for variant, key in self._last_keys.items():
            self._plan_wrapper(variant, key)

    def _wrapper(self, variant: LayerVariant) -> Any:
        wrapper = self._wrappers.get(variant)
        if wrapper is None:
            cls = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
            if self._capture_shape is None:
                wrapper = cls(self._workspace, kv_layout="NHD")
            else:
                n, width = self._capture_shape

                def buf(size: int) -> torch.Tensor:
                    return torch.zeros(size, dtype=torch.int32, device=self._device)

                wrapper = cls(self._workspace, kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=buf(n + 1),
                              paged_kv_indptr_buf=buf(n + 1), paged_kv_indices_buf=buf(n * width),
                              paged_kv_last_page_len_buf=buf(n))
            self._wrappers[variant] = wrapper
        return wrapper

    def _plan_wrapper(self, variant: LayerVariant, key: tuple[Any, ...]) -> None:
        heads, kv_heads, head_dim, q_dtype, kv_dtype, scale = key
        assert self._meta is not None
        self._wrapper(variant).plan(
            *self._arrays, heads, kv_heads, head_dim, self._meta.block_size, causal=True, sm_scale=scale,
            window_left=variant.window_left, logits_soft_cap=variant.logits_soft_cap,
            q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned[variant] = self._last_keys[variant] = key

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
        if self._meta is None or self._plan is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before prepare")
        if is_quantized(kv_layer.dtype):
            raise ValueError(
                f"the flashinfer backend does not read {kv_layer.dtype} KV caches (per-block scales); "
                "use attention_backend='triton' or 'auto'"
            )
        check_features(q.shape[1], q.device, window, sinks, softcap)
        variant = flashinfer_variant(window, sinks, softcap)
        if variant is None:
            return self._triton.forward(q, k, v, kv_layer, scale, kv_scales, window=window, sinks=sinks,
                                        softcap=softcap)
        _, _, bs, kv_heads, head_dim = kv_layer.shape
        rows = kv_layer.view(-1, kv_heads, head_dim)
        # static: from the slot mapping's buffer, inside the graph; else from prepare
        at = write_rows(self._meta.slot_mapping, bs) if self._static else self._write_rows
        rows.index_copy_(0, at, k.to(kv_layer.dtype))
        rows.index_copy_(0, at + bs, v.to(kv_layer.dtype))
        key = (q.shape[1], kv_heads, head_dim, q.dtype, kv_layer.dtype, scale)
        if self._planned.get(variant) != key:  # never during a capture: the warm-up planned this key
            self._plan_wrapper(variant, key)
        order = self._token_order
        planned_q = q if order is None else q.index_select(0, order)
        out: torch.Tensor = self._wrappers[variant].run(planned_q, kv_layer)
        if order is None:
            return out
        return torch.empty_like(out).index_copy_(0, order, out)
