"""Quantized Hugging Face checkpoints: what ``quantization_config`` says, and the weights read back.

A folder's ``config.json`` may carry ``quantization_config``; its ``quant_method`` names the scheme.
Two are read (``KNOWN_METHODS``); any other is refused with that list, never loaded as if it were plain:

- ``fp8``: a quantized ``X.weight`` is ``float8_e4m3fn`` and its scale lies beside it, either
  ``X.weight_scale_inv`` over ``weight_block_size`` blocks (``[out/bo, in/bi]`` rounded up: DeepSeek-V3/R1
  and transformers' fine-grained fp8, 128 x 128) or ``X.weight_scale`` per tensor (``[]`` or ``[1]``) or per
  output channel (``[out]`` or ``[out, 1]``). A value is its code times its scale (``weight_scale_inv``
  is, despite its name, the multiplier). ``X.input_scale`` (a static activation scale, for fp8 products)
  is not read: the products run in the model dtype on the dequantized weight.
- ``mxfp4`` (gpt-oss's experts): ``X_blocks`` (uint8, ``[..., rows, G, 16]``: two e2m1 codes a byte, the
  low nibble first) and ``X_scales`` (uint8, ``[..., rows, G]``: a power of two biased by 127) give ``X``,
  each 32 values of a row times their group's power of two, laid out as the bf16 checkpoint stores ``X``
  (``[..., G x 32, rows]``: input-major), as transformers reads it.

The weights are dequantized to float32 as they are read (``dequantized``), so a quantized checkpoint
runs as its dequantized model does. Asked to keep them (``keep``: ``--dtype auto`` on CPU with the native
product, one rank), an fp8 matrix whose scales cover whole runs of 32 inputs (block widths that are
multiples of 32, as DeepSeek's 128; channel and tensor scales) comes out as its codes instead, a
``kernels.gguf_blocks`` ``FP8`` matrix (``fp8_blocks``): the native product multiplies the codes as read,
with the dequantized model's values exactly, in a byte and an eighth a weight. MXFP4 experts come out
as a ``BlockStack`` of Q5_0 rows holding the same values (``mxfp4_stack``: 5.5 bits a weight), which
gpt-oss's ``canonical`` splits per expert like the floats. With a tensor-parallel shard, a quantized
tensor is read whole, dequantized, then cut (its scales' blocks need not align with the ranks' cuts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import QUANTIZATION_METHODS as KNOWN_METHODS
from engine.tensor_parallel import TpShard
from kernels.gguf_blocks import BLOCK_BYTES, QK, BlockKind, BlockMatrix, BlockStack, fp8_matrix

_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP8_SCALES = (".weight_scale_inv", ".weight_scale")
_SKIPPED = (".input_scale",)


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization: the method and, for block-scaled fp8, the block's rows and columns."""

    method: str
    block: tuple[int, int] | None = None


def checkpoint_quant(raw: dict[str, Any], source: Path) -> CheckpointQuant | None:
    """The ``quantization_config`` of a parsed ``config.json`` (``None``: not quantized); ValueError for a
    method not in ``KNOWN_METHODS`` or an fp8 format other than e4m3."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    if method not in KNOWN_METHODS:
        raise ValueError(f"{source}: quantization_config.quant_method {method or qc!r} is not supported; "
                         f"supported: {', '.join(KNOWN_METHODS)}")
    assert isinstance(qc, dict)
    if method == "mxfp4":
        return CheckpointQuant("mxfp4")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{source}: fp8 format {fmt!r} is not supported; supported: e4m3")
    block = qc.get("weight_block_size")
    if block is None:
        return CheckpointQuant("fp8")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: quantization_config.weight_block_size must be two positive integers, "
                         f"got {block!r}")
    return CheckpointQuant("fp8", (block[0], block[1]))


def check_flag(flag: str | None, kind: str, quant: CheckpointQuant | None, path: Path) -> None:
    """``--quantization`` (``flag``) against what the model at ``path`` is: ValueError naming the flag
    when it asks for what the checkpoint is not (quantizing a plain checkpoint at load is not done)."""
    if flag is None:
        return
    if kind != "hf":
        raise ValueError(f"--quantization {flag}: {path} is a GGUF file, which carries its own tensor "
                         f"types; leave the flag out")
    if quant is None:
        raise ValueError(f"--quantization {flag}: {path} has no quantization_config (quantizing a "
                         f"checkpoint at load is not supported; load one quantized with {flag})")
    if quant.method != flag:
        raise ValueError(f"--quantization {flag}: {path} is quantized with {quant.method}")


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   name: str) -> torch.Tensor:
    """``codes`` (float8_e4m3fn ``[out, in]``) times ``scale`` as float32: one scale per block of ``block``
    rows and columns, or per tensor / per output channel when ``block`` is None."""
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: a quantized fp8 weight must be float8_e4m3fn, got {codes.dtype}")
    values = codes.to(torch.float32)
    scale = scale.to(torch.float32)
    out_f = values.shape[0]
    if block is not None:
        bo, bi = block
        rows, cols = -(-values.shape[0] // bo), -(-values.shape[1] // bi)
        if tuple(scale.shape) != (rows, cols):
            raise ValueError(f"{name}: block scales of shape {tuple(scale.shape)}, expected {(rows, cols)} "
                             f"for a {tuple(values.shape)} weight in {bo} x {bi} blocks")
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        return values * full[: values.shape[0], : values.shape[1]]
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.numel() == out_f:
        return values * scale.reshape(out_f, *([1] * (values.dim() - 1)))
    raise ValueError(f"{name}: a scale of shape {tuple(scale.shape)} is neither per tensor nor per output "
                     f"channel of a {tuple(values.shape)} weight (a block-scaled checkpoint names "
                     f"weight_block_size)")


def fp8_blocks(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> BlockMatrix | None:
    """``codes`` and ``scale`` (as ``dequantize_fp8`` takes them) as an ``FP8`` matrix of one scale per row
    and 32 inputs, or None where a run of 32 inputs would span two scales (block widths that are not a
    multiple of 32), the input width is not a multiple of 32 or a code is NaN (the caller dequantizes)."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or codes.shape[1] % QK:
        return None
    if ((codes.view(torch.uint8) & 0x7F) == 0x7F).any():  # NaN codes: the native product reads no NaN
        return None
    out_f, in_f = codes.shape
    scale = scale.to(torch.float32)
    if block is not None:
        bo, bi = block
        if bi % QK or tuple(scale.shape) != (-(-out_f // bo), -(-in_f // bi)):
            return None
        per_row = scale.repeat_interleave(bo, 0)[:out_f]  # [out, in / bi]
        spread = per_row[:, torch.arange(in_f // QK) * QK // bi]
    elif scale.numel() == 1:
        spread = scale.reshape(1, 1).expand(out_f, in_f // QK)
    elif scale.numel() == out_f:
        spread = scale.reshape(out_f, 1).expand(out_f, in_f // QK)
    else:
        return None
    return fp8_matrix(codes, spread.contiguous())


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """``X`` from ``X_blocks`` and ``X_scales`` as float32, input-major (see the module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype} do not match")
    if blocks.dim() < 3:
        raise ValueError(f"{name}: MXFP4 blocks must be [..., rows, groups, 16], got {tuple(blocks.shape)}")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., rows, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    rows = values.flatten(-2)  # [..., rows, G x 32]
    return rows.transpose(-1, -2).contiguous()


def mxfp4_stack(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> BlockStack | None:
    """MXFP4 experts (``[E, rows, G, 16]`` blocks, ``[E, rows, G]`` scales) as ``Q5_0`` rows of the same
    values, one matrix ``[rows, G x 32]`` per expert (out-major, as the blocks store the rows), or None
    when a scale is out of float16's reach (the caller dequantizes).

    A value ``v * 2**(s - 127)`` (``v`` an e2m1 value, a multiple of 0.5 up to 6) is ``d * (q - 16)`` with
    the 5-bit code ``q = 2 v + 16`` (4 to 28) and ``d = 2**(s - 128)``: float16 holds that power of two for
    ``s`` in 104..143 (subnormals included), and ``d * (q - 16)`` is one exact float32 product, so the
    native product reads the dequantized model's values. Q5_0 takes 5.5 bits a weight against the file's
    4.25 (Q8_0's codes ``2 v`` would take 8.5, float32 32); every kernel that multiplies Q5_0 (both
    activation modes) reads it."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype} do not match")
    if blocks.dim() != 4 or bool(((scales < 104) | (scales > 143)).any()):
        return None
    experts, rows, groups, _ = blocks.shape
    shifted = torch.tensor([round(2 * v) + 16 for v in _FP4_VALUES], dtype=torch.int32)
    q = torch.stack((shifted[(blocks & 0x0F).long()], shifted[(blocks >> 4).long()]), dim=-1).flatten(-2)
    # gguf's Q5_0 record: d, a little-endian word of fifth bits (bit e: element e), then element e's low
    # nibble in byte e's low half and element e + 16's in its high half
    low = ((q[..., : QK // 2] & 15) | ((q[..., QK // 2 :] & 15) << 4)).to(torch.uint8)
    fifth = (((q >> 4) & 1) << torch.arange(QK, dtype=torch.int32)).sum(dim=-1, dtype=torch.int32)
    d = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 128).to(torch.float16)
    parts = [d.unsqueeze(-1).view(torch.uint8), fifth.unsqueeze(-1).view(torch.uint8), low]
    record = torch.cat(parts, dim=-1)  # [experts, rows, G, 22]
    flat = record.reshape(experts, rows, groups * BLOCK_BYTES[BlockKind.Q5_0])
    return BlockStack(tuple(BlockMatrix(BlockKind.Q5_0, flat[e].contiguous(), groups * QK)
                            for e in range(experts)))


def dequantized(files: list[Path], quant: CheckpointQuant, shard: TpShard | None, keep: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | BlockMatrix | BlockStack]]:
    """Every weight of ``files`` as float32 where it was quantized (the others as stored), scales consumed;
    ``shard``'s slice of each when given; with ``keep`` (and no shard), the fp8 matrices ``fp8_blocks``
    takes as their codes and the MXFP4 stacks ``mxfp4_stack`` takes as Q5_0 rows."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 - not a mapping

        def get(name: str) -> torch.Tensor:
            return where[name].get_tensor(name)

        for name in where:
            if name.endswith(_SKIPPED) or (quant.method == "fp8" and name.endswith(_FP8_SCALES)):
                continue
            if quant.method == "mxfp4" and name.endswith("_scales"):
                continue
            out_name, tensor = name, None
            if quant.method == "mxfp4" and name.endswith("_blocks"):
                out_name = name.removesuffix("_blocks")
                if out_name + "_scales" not in where:
                    raise ValueError(f"{name}: no {out_name}_scales beside it")
                kept_rows = mxfp4_stack(get(name), get(out_name + "_scales"), out_name) if keep else None
                if kept_rows is not None:
                    yield out_name, kept_rows
                    continue
                tensor = dequantize_mxfp4(get(name), get(out_name + "_scales"), out_name)
            elif quant.method == "fp8" and name.endswith(".weight"):
                scale = next((name + s.removeprefix(".weight") for s in _FP8_SCALES
                              if name + s.removeprefix(".weight") in where), None)
                if scale is not None:
                    kept = fp8_blocks(get(name), get(scale), quant.block) if keep else None
                    if kept is not None:
                        yield name, kept
                        continue
                    tensor = dequantize_fp8(get(name), get(scale), quant.block, name)
            if tensor is None:
                tensor = get(name)
                if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                    raise ValueError(f"{name}: an fp8 tensor without a weight_scale or weight_scale_inv")
            cut = shard.weight_slice(out_name) if shard is not None else None
            yield out_name, (cut.take(tensor).contiguous() if cut is not None else tensor)
