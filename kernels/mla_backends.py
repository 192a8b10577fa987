"""Latent attention's decode rows on the native CPU kernel and the Triton kernel, and which one to use.

Both backends are ``kernels/mla.MlaTorchBackend`` with its ``mix`` (the absorbed form's attention over
the latent rows) replaced for decode groups (``q_len`` 1): the cache write, the query absorption
(``w_uk``), the value projection (``w_uv``) and every prompt chunk (the expanded form) stay the
reference's. Each kernel reads the paged latent cache in place, every row once for all the heads it
serves:

- ``MlaNativeBackend``: ``kernels/cpu_mla.c`` (float32, bfloat16 and every quantized cache; its header
  has the work split), built into the native library of ``kernels/cpu_native.py``.
- ``MlaTritonBackend``: ``kernels/triton_mla.py`` on CUDA (interpreted on CPU under
  ``TRITON_INTERPRET=1``, which is how the tests run it), launched with
  ``kernels/triton_configs.mla_launch``. A float32 model over a quantized latent has no build
  (``mla_supported``) and keeps the reference's form.

``mla_backend`` picks per device as ``get_attention_backend`` does for the other caches: ``auto`` is
the native kernel on CPU (when it builds and ``native_kernels`` is on) and Triton on CUDA (when
installed), else the torch reference; ``flashinfer`` has no latent kernel here and takes ``auto``'s
choice.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from kernels.cpu_native import load_library, native_available
from kernels.kv_quant import code_values
from kernels.mla import MlaTorchBackend, SeqGroup

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # cpu_mla.c's; 8-bit codes are 2


class MlaNativeBackend(MlaTorchBackend):
    """Decode rows through ``pdserve_mla_decode`` (``kernels/cpu_mla.c``)."""

    def __init__(self, absorb: bool | None = None, num_threads: int | None = None) -> None:
        super().__init__(absorb)
        lib = load_library()
        if lib is None:
            raise RuntimeError("native CPU kernel library is unavailable")
        self._kernel = lib.pdserve_mla_decode
        self._num_threads = num_threads

    def mix(self, group: SeqGroup, query: torch.Tensor, kv_layer: torch.Tensor,
            kv_scales: torch.Tensor | None, rank: int, scale: float) -> torch.Tensor:
        if group.q_len != 1 or kv_layer.device.type != "cpu" or not kv_layer.is_contiguous():
            return super().mix(group, query, kv_layer, kv_scales, rank, scale)
        n, _, heads, dim = query.shape
        out = torch.empty(n, 1, heads, rank, dtype=torch.float32)
        if kv_scales is None:
            if kv_layer.dtype not in _DTYPE_CODES:
                return super().mix(group, query, kv_layer, kv_scales, rank, scale)
            code, scales, values = _DTYPE_CODES[kv_layer.dtype], None, None
        else:
            code, scales = 2, kv_scales.contiguous()
            values = code_values(kv_layer.dtype)
        status = self._kernel(
            query.data_ptr(), out.data_ptr(), kv_layer.data_ptr(),
            None if scales is None else scales.data_ptr(), None if values is None else values.data_ptr(),
            group.lens.data_ptr(), group.tables.data_ptr(), n, group.tables.shape[1],
            heads, dim, rank, kv_layer.shape[2], scale, code, self._num_threads or torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"native latent attention failed with code {status}")
        return out


class MlaTritonBackend(MlaTorchBackend):
    """Decode rows through ``mla_decode_kernel`` (``kernels/triton_mla.py``); ``model_dtype`` is the
    dtype its dots take the queries in (the model's)."""

    def __init__(self, model_dtype: torch.dtype, absorb: bool | None = None) -> None:
        super().__init__(absorb)
        self.model_dtype = model_dtype

    def mix(self, group: SeqGroup, query: torch.Tensor, kv_layer: torch.Tensor,
            kv_scales: torch.Tensor | None, rank: int, scale: float) -> torch.Tensor:
        from kernels import triton_mla
        from kernels.triton_configs import interpreting, mla_launch, mla_supported, storage_dtype

        interpret = interpreting()
        if group.q_len != 1 or not (interpret or mla_supported(self.model_dtype, kv_layer.dtype)):
            return super().mix(group, query, kv_layer, kv_scales, rank, scale)
        n, _, heads, dim = query.shape
        cfg = mla_launch(self.model_dtype, kv_layer.dtype, rank, dim - rank, interpret)
        q = query[:, 0] if interpret else query[:, 0].to(self.model_dtype)
        out = torch.empty(n, heads, rank, dtype=torch.float32, device=query.device)
        cache = kv_layer.view(storage_dtype(kv_layer.dtype)).view(-1, dim)
        scales = kv_scales if kv_scales is not None else out  # unread for a plain cache
        grid = (n, -(-heads // int(cfg.constexprs["BLOCK_H"])))
        triton_mla.mla_decode_kernel[grid](
            q, out, cache, scales, group.tables, group.lens, scale * math.log2(math.e), heads,
            kv_layer.shape[2],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), group.tables.stride(0), cache.stride(0),
            num_warps=cfg.num_warps, **cfg.constexprs,
        )
        return out[:, None]


def mla_backend(device: torch.device | str, name: str = "auto", native_kernels: bool = True,
                model_dtype: torch.dtype = torch.float32) -> MlaTorchBackend:
    """A latent cache's backend for ``device`` and the configured ``attention_backend`` ``name``."""
    kind = torch.device(device).type
    if name in ("auto", "flashinfer"):
        if kind == "cpu":
            name = "native" if native_kernels and native_available() else "torch"
        elif kind == "cuda" and importlib.util.find_spec("triton") is not None:
            name = "triton"
        else:
            name = "torch"
    if name == "native":
        return MlaNativeBackend()
    if name == "triton":
        from kernels.triton_configs import interpreting

        if kind != "cuda" and not interpreting():
            raise ValueError(f"attention_backend='triton' needs a CUDA device, got {kind!r}")
        return MlaTritonBackend(model_dtype)
    if name == "torch":
        return MlaTorchBackend()
    raise ValueError(f"attention_backend must be auto, triton, flashinfer or torch, got {name!r}")
