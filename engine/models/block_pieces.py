"""The GGUF blocks of a fused matrix, gathered as ``CausalLM.load_weights`` reads its parts.

A fused matrix (attention's QKV, the MLP's or an expert's gate/up) arrives as several Hugging Face tensors,
each a ``kernels.gguf_blocks.BlockMatrix`` of its rows. ``BlockPieces`` keeps each part with its first row;
``finish`` stacks a matrix's parts in row order and hands it to its module (``Prepared.set_blocks``) when
they are blocks that fill it (of one kind, or of several GGUF kinds as ``KMIX`` rows, ``kernels/kmix.py``),
and otherwise (a part in floats, an fp8 part beside GGUF ones) dequantizes each part into its float target.
"""

from __future__ import annotations

import torch

from engine.layers.prepared import Prepared
from kernels.gguf_blocks import BlockMatrix
from kernels.kmix import cat_rows


class BlockPieces:
    def __init__(self) -> None:
        self._parts: dict[tuple[Prepared, str, int | None], list[tuple[int, str, BlockMatrix]]] = {}

    def add(self, module: Prepared, attr: str, row: int, name: str, matrix: BlockMatrix,
            expert: int | None = None) -> None:
        """Part ``name`` of ``module.<attr>`` (of its matrix ``expert`` when that is a stack), starting at
        ``row``."""
        self._parts.setdefault((module, attr, expert), []).append((row, name, matrix))

    def finish(self, targets: dict[str, torch.Tensor]) -> None:
        """Hand each gathered matrix to its module, or dequantize its parts into ``targets``."""
        for (module, attr, expert), parts in self._parts.items():
            parts.sort(key=lambda part: part[0])
            joined = cat_rows([matrix for _, _, matrix in parts])
            param = getattr(module, attr)
            shape = param.shape if expert is None else param.shape[1:]
            if joined is not None and tuple(joined.shape) == tuple(shape):
                module.set_blocks(attr, joined, expert)
            else:
                for _, name, matrix in parts:
                    targets[name].copy_(matrix.dequantize())
        self._parts.clear()
