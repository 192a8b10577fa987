"""A GGUF file with its block-quantized matrices stored in another GGUF type, for the precision tables.

llama.cpp's ``llama-quantize`` is a C++ tool that is not on these machines, and ``gguf`` has no
requantizer; this copies a file's metadata and tensors with ``gguf``'s reader and writer, and stores
every matrix of a ``--from`` type (default: any block type) as ``--to`` (``gguf.quants.quantize`` of its
dequantized values). The result has the new type's bytes and speed; its values are the old file's
rounded again, so its quality is a little below a file quantized from the original weights.

    python -m bench.lab.requantize --model SRC.gguf --to Q8_0 --out DST.gguf [--from Q4_1]
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.loader import resolve_model

_SKIPPED_FIELDS = ("GGUF.", "general.architecture")


def requantize(src: str, dst: str, to: GGMLQuantizationType, only: GGMLQuantizationType | None) -> int:
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
    for tensor in reader.tensors:
        stored: GGMLQuantizationType = tensor.tensor_type
        blocks = stored not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        if blocks and (only is None or stored == only) and stored != to:
            values = np.asarray(dequantize(tensor.data, stored), dtype=np.float32)
            data = quantize(values, to)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=to)
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
    parser.add_argument("--to", required=True, choices=[t.name for t in GGMLQuantizationType])
    parser.add_argument("--from", dest="only", default=None, choices=[t.name for t in GGMLQuantizationType])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    only = GGMLQuantizationType[args.only] if args.only else None
    changed = requantize(str(resolve_model(args.model)), args.out, GGMLQuantizationType[args.to], only)
    print(f"{args.out}: {changed} tensors stored as {args.to}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
