"""Weights quantized to llama.cpp's K formats (Q4_K, Q5_K, Q6_K), for the tests' model files and the lab
benchmarks (``bench.lab.block_products``): ``gguf.quants`` reads these formats but cannot write them.

The scales are picked simply (each sub-block's range, then the super-block's float16 scale over them), not
by llama.cpp's search for the least error, so a matrix here is a valid block of its format whose values
``gguf.quants.dequantize`` gives, close to the input (within a step of its sub-block's scale), which is
all a test of the formats' arithmetic, or a timing, needs. Their quality is not llama.cpp's.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

QK_K = 256


def quantize_k(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` (float32 ``[..., in]``, ``in`` a multiple of 256) as ``qtype`` blocks, ``uint8 [..., in / 256
    * block bytes]``."""
    *lead, width = data.shape
    if width % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, not {width}")
    x = np.asarray(data, dtype=np.float32).reshape(-1, QK_K)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks = _q6_k(x)
    else:
        blocks = _q4_k(x, 5 if qtype == GGMLQuantizationType.Q5_K else 4)
    return blocks.reshape(*lead, width // QK_K * blocks.shape[-1])


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _q4_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (``bits`` 4) or Q5_K (5: the fifth bits in 32 bytes before the nibbles, bit j of byte l the
    sub-block j's input l)."""
    n, top = x.shape[0], (1 << bits) - 1
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - low) / top
    d, dmin = _half(scale.max(-1) / 63), _half(-low.min(-1) / 63)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.round((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(np.where(step[..., None] > 0, q, 0), 0, top).astype(np.uint8)
    packed = np.zeros((n, 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] = mn[:, :4] | (mn[:, 4:] >> 4) << 6
    packed[:, 8:12] = (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4
    pairs = (q & 15).reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(n, 128)
    scales = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8)]
    if bits == 4:
        return np.concatenate([*scales, packed, qs], axis=1)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= (q[:, j] >> 4) << j
    return np.concatenate([*scales, packed, qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _half(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    rounded = np.round(sub / np.where(step != 0, step, 1)[..., None])
    codes = np.clip(np.where(step[..., None] != 0, rounded, 0), -32, 31) + 32
    q = codes.astype(np.uint8).reshape(n, 2, 128)
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for part in range(2):  # values 64 part .. 64 part + 63 of each half: the high nibbles of ql
        ql |= (q[:, :, 64 * part:64 * part + 64] & 15) << (4 * part)
    for part in range(4):  # values 32 part .. of each half: bit pair `part` of qh
        qh |= (q[:, :, 32 * part:32 * part + 32] >> 4) << (2 * part)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.reshape(n, 1).view(np.uint8)], axis=1)


def quantize_any(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``data`` as ``qtype`` blocks: ``gguf.quants.quantize`` for the types it writes, ``quantize_k`` for
    Q4_K and Q6_K."""
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
        return quantize_k(data, qtype)
    return np.asarray(quantize(data, qtype))
