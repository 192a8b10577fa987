"""A GGUF file with its block-quantized matrices stored in another GGUF type, for the precision tables.

llama.cpp's ``llama-quantize`` is a C++ tool that is not on these machines, and ``gguf`` has no
requantizer; this copies a file's metadata and tensors with ``gguf``'s reader and writer, and stores
every matrix of a ``--from`` type (default: any block type) as ``--to`` (``gguf.quants.quantize`` of its
dequantized values; ``bench.lab.kquants`` for the K types). The result has the new type's bytes and speed;
its values are the old file's rounded again, so its quality is a little below a file quantized from the
original weights (and the K types' scales are picked more simply than llama.cpp picks them).

``--to Q4_K_M`` or ``Q5_K_M`` mixes types as ``llama-quantize`` does for those names: Q4_K (Q5_K), with
Q6_K for ``attn_v`` and ``ffn_down`` in the layers that get more bits (the first and last eighth, and
every third between) and for the LM head (the embedding, when tied); a matrix whose width is not a
multiple of 256 takes llama.cpp's fallback (Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0).

    python -m bench.lab.requantize --model SRC.gguf --to Q8_0 --out DST.gguf [--from Q4_1]
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bench.lab.kquants import quantize_any
from engine.loader import resolve_model

_SKIPPED_FIELDS = ("GGUF.", "general.architecture")


MIXES = {"Q4_K_M": GGMLQuantizationType.Q4_K, "Q5_K_M": GGMLQuantizationType.Q5_K}
_Q = GGMLQuantizationType
FALLBACK = {_Q.Q4_K: _Q.Q5_0, _Q.Q5_K: _Q.Q5_1, _Q.Q6_K: _Q.Q8_0}  # widths not a multiple of 256


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mixed_type(name: str, width: int, base: GGMLQuantizationType, layers: int,
               tied: bool) -> GGMLQuantizationType:
    """The type ``llama-quantize``'s Q4_K_M / Q5_K_M (``base`` Q4_K / Q5_K) gives a matrix."""
    chosen = base
    parts = name.split(".")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        chosen = GGMLQuantizationType.Q6_K
    elif len(parts) > 2 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        chosen = GGMLQuantizationType.Q6_K if _more_bits(int(parts[1]), layers) else base
    return FALLBACK.get(chosen, chosen) if width % 256 else chosen


def requantize(src: str, dst: str, to: GGMLQuantizationType | str,
               only: GGMLQuantizationType | None) -> int:
    """Write ``dst``; returns how many tensors were requantized."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith(_SKIPPED_FIELDS):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    changed = 0
    layers = sum(1 for t in reader.tensors if t.name.endswith("attn_v.weight"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    for tensor in reader.tensors:
        stored: GGMLQuantizationType = tensor.tensor_type
        blocks = stored not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        width = int(tensor.shape[0])  # GGUF lists the innermost dimension first
        target = (mixed_type(tensor.name, width, MIXES[to], layers, tied) if isinstance(to, str)
                  else to)
        if blocks and (only is None or stored == only) and stored != target:
            values = np.asarray(dequantize(tensor.data, stored), dtype=np.float32)
            data = quantize_any(values, target)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=target)
            changed += 1
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the source GGUF (default: the built-in model)")
    parser.add_argument("--to", required=True, choices=[*(t.name for t in GGMLQuantizationType), *MIXES])
    parser.add_argument("--from", dest="only", default=None, choices=[t.name for t in GGMLQuantizationType])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    only = GGMLQuantizationType[args.only] if args.only else None
    to = args.to if args.to in MIXES else GGMLQuantizationType[args.to]
    changed = requantize(str(resolve_model(args.model)), args.out, to, only)
    print(f"{args.out}: {changed} tensors stored as {args.to}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
