"""The native CPU attention backend: ``cpu_attention.c`` built on first use and called through ctypes.

The same library holds ``cpu_attention_blocked.c`` (the kernel for prompt chunks), ``cpu_kv_codes.c``
(a quantized cache's writes, and its rows converted a tile at a time for both),
``cpu_attention_mass.c`` (the blocks' attention mass for ``--kv-eviction``), ``cpu_ops.c`` (the
per-layer small ops and the few-row product; ``kernels/native_ops.py`` wraps them, as it does
``cpu_packed.c``, ``cpu_qrecords.c`` (GGUF blocks' records), ``cpu_qpacked.c``, ``cpu_qint8.c`` (with
``cpu_qint8_pairs.c``) and ``cpu_bf16.c``, the products), ``cpu_decoder.c`` (every layer of a few-row
step in one call; ``kernels/native_decoder.py``), ``cpu_greedy.c`` (the greedy head's screen;
``kernels/greedy_head.py``) and ``cpu_mla.c`` (latent attention's absorbed decode form;
``kernels/mla_backends.py``). All run their threads through OpenMP
(``-fopenmp``): the library's ``libgomp.so.1`` resolves to the copy torch already
loaded, so the kernels share torch's thread team instead of starting threads that
compete with its spinning ones for the same cores.

The kernel reads K/V in place from the paged cache (no gather), which is what makes
CPU decode fast: the torch reference copies every sequence's K/V into a workspace
before ``scaled_dot_product_attention`` reads it again.

Build cache: ``$PDSERVE_CACHE/kernels`` (default ``~/.cache/pdserve/kernels``); the
library's file name carries a hash of the C sources, the compiler's version, the
flags and the CPU model, so an edit (or a new compiler) builds a new library and
a stale one is never loaded. Each build writes a temporary file and renames it into
place, so concurrent processes never load a half-written library.

``--no-native-kernels`` (``EngineConfig.native_kernels``) keeps an engine off it. A missing compiler
or a failed build logs one warning and the torch backend is used instead; nothing crashes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kernels import kv_int4
from kernels.attention import AttentionMetadata
from kernels.kv_quant import is_quantized, stored_head_dim
from kernels.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_attention.c", "cpu_attention_blocked.c", "cpu_attention_plan.c",
                             "cpu_attention_mass.c", "cpu_kv_codes.c", "cpu_ops.c", "cpu_packed.c",
                             "cpu_qrecords.c", "cpu_qpacked.c", "cpu_qint8.c", "cpu_qint8_pairs.c",
                             "cpu_bf16.c", "cpu_decoder.c", "cpu_greedy.c", "cpu_mla.c"))
# included by the sources: part of the build's hash
HEADERS = tuple(Path(__file__).with_name(name) for name in ("cpu_simd.h", "cpu_internal.h", "cpu_qint8.h"))
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC", "-fopenmp")
SUPPORTED_MACHINES = ("x86_64", "aarch64")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# a quantized cache's formats (cpu_internal.h's DTYPE_*; kernels/cpu_kv_codes.c)
QUANT_CODES = {torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, kv_int4.STORAGE_DTYPE: 5}
_MAX_HEAD_DIM = 256


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def library_name(source: bytes, compiler_version: str, cpu_model: str = "") -> str:
    """File name of the library built from ``source``: changes whenever any input of the build does."""
    digest = hashlib.sha256()
    for part in (source, compiler_version.encode(), " ".join(CFLAGS).encode(), cpu_model.encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"cpu_kernels-{digest.hexdigest()[:20]}.so"


def _compiler_version(cc: str) -> str:
    result = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=60)
    return result.stdout.splitlines()[0] if result.stdout else cc


def build_library(directory: Path | None = None) -> Path:
    """Compile the C sources unless the cache already holds this exact build; return its path."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"C compiler {cc!r} not found")
    directory = directory or cache_dir()
    source = b"\0".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    path = directory / library_name(source, _compiler_version(cc), _cpu_model())
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The built and loaded kernel library, or ``None`` (with one warning) when it cannot be had."""
    try:
        lib = ctypes.CDLL(str(build_library()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU attention unavailable, using the torch backend: %s", exc)
        return None
    fn = lib.pdserve_paged_attention
    fn.restype = ctypes.c_int32
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # q, q stride, kv, out
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # query_start_loc, seq_lens, block_tables
        ctypes.c_int32, ctypes.c_int32,  # num_seqs, table width
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,  # heads, kv heads, head_dim, block
        ctypes.c_float, ctypes.c_int32,  # scale, dtype
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # scales, new K, new V
        ctypes.c_void_p, ctypes.c_void_p,  # each row's running max and sum out (or None)
        ctypes.c_int32,  # num_threads
    ]
    mass = lib.pdserve_attention_mass
    mass.restype = ctypes.c_int32
    mass.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # q, q stride, kv
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # query_start_loc, seq_lens, block_tables
        ctypes.c_int32, ctypes.c_int32,  # num_seqs, table width
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,  # heads, kv heads, head_dim, block
        ctypes.c_float, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,  # scale, dtype, scales, new K
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # max, sum, mass, its stride
        ctypes.c_int32,  # threads
    ]
    write = lib.pdserve_kv_write
    write.restype = ctypes.c_int32
    write.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,  # kv, scales, format
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # K, V, slots, tokens
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,  # block size, kv heads, dim, threads
    ]
    bind_ops(lib)
    return lib


def bind_ops(lib: ctypes.CDLL) -> None:
    """Declare the signatures of ``cpu_ops.c``'s, ``cpu_packed.c``'s, ``cpu_decoder.c``'s and
    ``cpu_mla.c``'s functions (pointers as ``c_void_p``)."""
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    signatures = {
        "pdserve_pack_f32": [ptr, ptr, i64, i64],  # w, packed, n, k
        # packed weight, x, bias, y, m, n, k, threads
        "pdserve_packed_f32": [ptr, ptr, ptr, ptr, i64, i64, i64, i32],
        "pdserve_add_rms_norm_f32": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],  # h, delta, w, out, rows, dim
        "pdserve_rope_f32": [ptr, i64, ptr, ptr, i64, i32, i32, i32],  # x, stride, cos, sin, T, heads, hd
        "pdserve_silu_mul_f32": [ptr, ptr, i64, i64, i32],  # gate_up, out, rows, inter, threads
        "pdserve_screen_f16": [ptr, ptr, ptr, i64, i64, i64, i32],  # q, x, y, m, n, k, threads
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = argtypes
    blocks: dict[str, tuple[Any, list[Any]]] = {  # cpu_qpacked.c: the format first
        "pdserve_qpack": (i32, [i32, ptr, ptr, i64, i64]),  # raw rows, packed, n, k
        "pdserve_qdequantize": (i32, [i32, ptr, ptr, i64, i64]),  # packed, float panels, n, k
        # packed, x, bias, y, m, n, k, threads
        "pdserve_qpacked_f32": (i32, [i32, ptr, ptr, ptr, ptr, i64, i64, i64, i32]),
        "pdserve_qrecord_bytes": (i64, [i32]),
        "pdserve_i8_available": (i32, []),  # cpu_qint8.c: whether the build has the int8 product
        # cpu_bf16.c: w, packed, n, k; packed, floats, n, k; the product; vdpbf16ps or plain FMAs
        "pdserve_pack_bf16": (None, [ptr, ptr, i64, i64]),
        "pdserve_unpack_bf16": (None, [ptr, ptr, i64, i64]),
        "pdserve_packed_bf16": (i32, [ptr, ptr, ptr, ptr, i64, i64, i64, i32]),
        "pdserve_bf16_native": (i32, []),
    }
    for name, (restype, argtypes) in blocks.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    mla = lib.pdserve_mla_decode
    mla.restype = i32
    mla.argtypes = [
        ptr, ptr, ptr, ptr, ptr,  # q, out, cache, block scales, code values
        ptr, ptr, i32, i32,  # seq_lens, block tables, sequences, table width
        i32, i32, i32, i32, f32, i32, i32,  # heads, latent dim, rank, block size, scale, dtype, threads
    ]
    candidates = lib.pdserve_screen_candidates
    candidates.restype = i64
    candidates.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64]  # y, c, x, m, n, k, out, cap
    decoder = lib.pdserve_decoder_f32
    decoder.restype = i32
    decoder.argtypes = [
        ptr, i32, ptr, i64,  # layer weight pointers, num_layers, kv cache, bytes between layers
        i32, ptr, i64,  # the cache's format, a quantized cache's scales, scale floats between layers
        ptr, ptr, ptr, ptr, ptr,  # hidden, out, workspace, cos, sin
        ptr, ptr, ptr, ptr,  # write rows, query_start_loc, seq_lens, block tables
        i32, i32, i64,  # sequences, table width, tokens
        i32, i32, i32, i32, i32, i32,  # hidden, heads, kv heads, head_dim, intermediate, block size
        f32, f32, ptr, ptr, i32,  # scale, eps, final norm, the blocks' attention mass (or None), threads
    ]


def native_available() -> bool:
    """Whether the native kernel can run here (builds it on the first call)."""
    if not sys.platform.startswith("linux") or platform.machine() not in SUPPORTED_MACHINES:
        return False
    return load_library() is not None


PagedArrays = tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class NativeCpuAttentionBackend:
    """``AttentionBackend`` for CPU caches in float32 or bfloat16 (q and the output in the cache's dtype) or
    quantized (int8, fp8 or int4 with their scales: q and the output in float32); anything else goes to the
    torch backend.

    A quantized cache is written natively with the torch reference's bytes (``kv_quant.write_quantized``'s
    requantize-on-write), then read in place: the kernels convert a tile of codes at a time to float32 and
    see each query's own K/V exact, as the torch reference does (``kernels/cpu_kv_codes.c``).

    ``num_threads`` defaults to ``torch.get_num_threads()`` at each call. Layers with a sliding window,
    sinks or a softcap go to the torch reference too (``features`` is empty).

    ``mass`` (``--kv-eviction``, ``engine/kv_eviction.py``): float32 ``[num_blocks, layers x kv_heads]``,
    to which every layer adds, in its columns, the attention probability each block's keys received from
    each KV head's query heads, as ``TorchAttentionBackend`` does (``mass_layer`` counts the layers since
    ``prepare``): the kernels hand out each row's softmax max and sum and ``cpu_attention_mass.c`` scores
    the keys again; a block written from its first row starts again from zero. Layers the torch reference
    takes score there, on the same tensor and layer.
    """

    features: frozenset[str] = frozenset()

    def __init__(self, num_threads: int | None = None, mass: torch.Tensor | None = None) -> None:
        lib = load_library()
        if lib is None:
            raise RuntimeError("native CPU attention library is unavailable")
        self._kernel = lib.pdserve_paged_attention
        self._write = lib.pdserve_kv_write
        self._mass_kernel = lib.pdserve_attention_mass
        if mass is not None and (mass.dtype != torch.float32 or mass.device.type != "cpu"
                                 or not mass.is_contiguous()):
            raise ValueError("the attention mass must be a contiguous float32 CPU tensor")
        self.mass = mass
        self.mass_layer = 0
        self._num_threads = num_threads
        self._meta: AttentionMetadata | None = None
        self._write_rows = torch.empty(0, dtype=torch.int64)
        self._slots = torch.empty(0, dtype=torch.int64)
        self._query_start_loc = torch.empty(0, dtype=torch.int32)
        self._seq_lens = torch.empty(0, dtype=torch.int32)
        self._block_tables = torch.empty(0, dtype=torch.int32)
        self._fallback = TorchAttentionBackend(mass=mass)
        self._fallback_meta: AttentionMetadata | None = None

    def paged_arrays(self) -> PagedArrays | None:
        """The prepared step as the kernels read it: ``(meta, write_rows, query_start_loc, seq_lens,
        block_tables)`` (int64 rows of the layer's ``[-1, kv_heads, head_dim]`` view where K goes, V
        ``block_size`` rows after; the rest int32), or None before ``prepare``."""
        if self._meta is None:
            return None
        return self._meta, self._write_rows, self._query_start_loc, self._seq_lens, self._block_tables

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        slots = self._slots = meta.slot_mapping.to("cpu", torch.int64)
        self._write_rows = torch.div(slots, bs, rounding_mode="floor") * (2 * bs) + slots % bs
        self._query_start_loc = meta.query_start_loc.to("cpu", torch.int32).contiguous()
        self._seq_lens = meta.seq_lens.to("cpu", torch.int32).contiguous()
        self._block_tables = meta.block_tables.to("cpu", torch.int32).contiguous()
        self._meta = meta
        self.mass_layer = 0
        if self.mass is not None:  # the fallback resets the mass of blocks written from their first row
            self._fallback.prepare(meta)
            self._fallback_meta = meta

    def supports(self, q: torch.Tensor, kv_layer: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> bool:
        _, _, block_size, kv_heads, stored = kv_layer.shape
        head_dim = q.shape[2]
        quantized = is_quantized(kv_layer.dtype)
        return (
            kv_layer.device.type == "cpu"
            and q.device.type == "cpu"
            and (kv_layer.dtype in _DTYPE_CODES
                 or (quantized and kv_scales is not None and kv_scales.is_contiguous()
                     and kv_scales.device.type == "cpu"))
            and stored == stored_head_dim(kv_layer.dtype, head_dim)
            and kv_layer.is_contiguous()
            and head_dim % 16 == 0
            and head_dim <= _MAX_HEAD_DIM
            and q.shape[1] % kv_heads == 0
            and block_size & (block_size - 1) == 0
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
        meta = self._meta
        if meta is None:
            raise RuntimeError("NativeCpuAttentionBackend.forward called before prepare")
        plain = window is None and sinks is None and softcap is None
        if not plain or not self.supports(q, kv_layer, kv_scales):
            if self._fallback_meta is not meta:
                self._fallback.prepare(meta)
                self._fallback_meta = meta
            self._fallback.mass_layer = self.mass_layer
            self.mass_layer += 1
            return self._fallback.forward(q, k, v, kv_layer, scale, kv_scales, window=window, sinks=sinks,
                                          softcap=softcap)
        bs = meta.block_size
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = kv_layer.shape[3]
        threads = self._num_threads or torch.get_num_threads()
        if is_quantized(kv_layer.dtype):
            assert kv_scales is not None
            compute, code = torch.float32, QUANT_CODES[kv_layer.dtype]
            k_new, v_new = (t.to(compute).contiguous() for t in (k, v))
            status = self._write(kv_layer.data_ptr(), kv_scales.data_ptr(), code, k_new.data_ptr(),
                                 v_new.data_ptr(), self._slots.data_ptr(), num_tokens, bs, kv_heads, head_dim,
                                 threads)
            if status != 0:
                raise RuntimeError(f"native KV write failed with code {status}")
            extra: tuple[int | None, ...] = (kv_scales.data_ptr(), k_new.data_ptr(), v_new.data_ptr())
        else:
            rows = kv_layer.view(-1, kv_heads, head_dim)
            rows.index_copy_(0, self._write_rows, k.to(kv_layer.dtype))
            rows.index_copy_(0, self._write_rows + bs, v.to(kv_layer.dtype))
            compute, code, extra = kv_layer.dtype, _DTYPE_CODES[kv_layer.dtype], (None, None, None)

        qc = q.to(compute)
        if qc.stride(2) != 1 or qc.stride(1) != head_dim:
            qc = qc.contiguous()
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=compute)
        if num_tokens == 0:
            return out.to(q.dtype)
        stats = torch.empty(2, num_tokens * num_heads) if self.mass is not None else None  # rows' max, sum
        width = self._block_tables.shape[1] if self._block_tables.dim() == 2 else 0
        shape = (num_heads, kv_heads, head_dim, bs)
        step = (self._query_start_loc.data_ptr(), self._seq_lens.data_ptr(), self._block_tables.data_ptr(),
                meta.num_seqs, width)
        status = self._kernel(
            qc.data_ptr(), qc.stride(0), kv_layer.data_ptr(), out.data_ptr(), *step, *shape, scale, code,
            *extra, *((None, None) if stats is None else (stats[0].data_ptr(), stats[1].data_ptr())), threads,
        )
        if status != 0:
            raise RuntimeError(f"native paged attention failed with code {status}")
        if stats is not None:
            self._add_mass(qc, kv_layer, step, shape, scale, code, extra, stats, threads)
        self.mass_layer += 1
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def _add_mass(self, qc: torch.Tensor, kv_layer: torch.Tensor, step: tuple[int, ...],
                  shape: tuple[int, ...], scale: float, code: int, extra: tuple[int | None, ...],
                  stats: torch.Tensor, threads: int) -> None:
        """Each block's share of this layer's attention probabilities per KV head, added to its columns of
        ``mass``."""
        assert self.mass is not None
        kv_heads, width = shape[1], self.mass.shape[1]
        first = self.mass_layer % (width // kv_heads) * kv_heads
        status = self._mass_kernel(
            qc.data_ptr(), qc.stride(0), kv_layer.data_ptr(), *step, *shape, scale, code, extra[0],
            extra[1], stats[0].data_ptr(), stats[1].data_ptr(), self.mass.data_ptr() + 4 * first, width,
            threads,
        )
        if status != 0:
            raise RuntimeError(f"native attention mass failed with code {status}")
