"""A module's matrices and their prepared products (``kernels.linear.PreparedLinear``).

A ``Prepared`` module names its matrices (``_matrices``: each parameter with the products built over
it, one for an ``[out, in]`` matrix, one per expert for an ``[E, out, in]`` stack) and builds the
products in ``_build_linears``; every operation below also reaches its ``Prepared`` children.
``prepare_linears`` (re)builds them from the current weights. The native kernel's products hold a
packed copy; unless ``keep_plain``, the plain matrices are then released (``release_plain``: each
becomes a zero-stride stand-in of its shape, 4 bytes) so the weights are in memory once, and
``restore_plain`` brings them back bitwise from the packed copies (loading weights, another kernel
and the compiled path read them).

A matrix may arrive in GGUF blocks instead (``set_blocks(name, matrix)`` before the build, with the
parameter left unfilled; ``set_blocks(name, matrix, expert)`` for one matrix of an ``[E, out, in]`` stack,
the others left floats or given blocks of their own): the build hands the blocks to its
``PreparedLinear``, which keeps them packed
(``kernels/gguf_blocks.py``), and forgets them; from then on the packed copy is the one copy, and
``restore_plain`` (or a build that keeps the plain matrices) fills the parameter with their dequantized
values. Only the native kernel takes blocks (the model dequantizes at load for any other).

``prepare_linears(..., bf16=True)`` (``--dtype bfloat16`` on CPU) turns every native float product into
the bfloat16 one (``PreparedLinear.to_bf16``) but those of ``_float32_matrices``; a kept plain matrix then
holds the bfloat16 values.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.gguf_blocks import BlockMatrix
from kernels.linear import LinearKernel, PreparedLinear


def weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised frozen parameter (every one is filled by ``load_weights``)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def released(param: torch.Tensor) -> bool:
    """Whether ``param`` is a released matrix's zero-stride stand-in."""
    return param.dim() >= 2 and param.numel() > 1 and all(s == 0 for s in param.stride())


class Prepared(nn.Module):
    """Base of the modules that own matrices; see the module docstring."""

    _built = False

    def _matrices(self) -> list[tuple[nn.Parameter, list[PreparedLinear]]]:
        return []

    def _build_linears(self, kernel: LinearKernel) -> None:
        """Build this module's products over its current matrices."""

    def _float32_matrices(self) -> list[nn.Parameter]:
        """The matrices whose products stay float32 under ``bf16`` (a router's: its top-k is a
        discontinuous pick that bfloat16's rounding would flip)."""
        return []

    def _parts(self) -> list[Prepared]:
        return [m for m in self.children() if isinstance(m, Prepared)]

    def set_blocks(self, name: str, matrix: BlockMatrix, expert: int | None = None) -> None:
        """Build matrix ``name`` (an attribute of this module; with ``expert``, that matrix of the stack
        ``name``) from GGUF blocks at the next build."""
        param = getattr(self, name)
        shape = tuple(param.shape if expert is None else param.shape[1:])
        if shape != tuple(matrix.shape):
            where = name if expert is None else f"{name}[{expert}]"
            raise ValueError(f"blocks of shape {matrix.shape} for {where} of shape {shape}")
        self.__dict__.setdefault("_pending_blocks", {})[(name, expert)] = matrix

    def blocks(self, name: str, expert: int | None = None) -> BlockMatrix | None:
        """The blocks ``set_blocks`` gave for ``name`` (its ``expert``) and no build has taken yet."""
        return self.__dict__.get("_pending_blocks", {}).get((name, expert))

    def prepare_linears(self, kernel: LinearKernel, keep_plain: bool = False, bf16: bool = False) -> None:
        if self._built:  # not the first build: the matrices may be released
            self._restore_own()
        self._build_linears(kernel)
        self._built = True
        self.__dict__.pop("_pending_blocks", None)
        if bf16:
            kept = {id(param) for param in self._float32_matrices()}
            for param, linears in self._matrices():
                if id(param) in kept:
                    continue
                for lin in linears:
                    lin.to_bf16()
        if not keep_plain:
            self._release_own()
        else:  # a matrix built from blocks was never filled; a bfloat16 one holds its rounded values
            for param, linears in self._matrices():
                if linears and (linears[0].kind is not None or linears[0].bf16):
                    self._fill_from_packed(param, linears)
        for part in self._parts():
            part.prepare_linears(kernel, keep_plain, bf16)

    def release_plain(self) -> None:
        self._release_own()
        for part in self._parts():
            part.release_plain()

    def restore_plain(self) -> None:
        self._restore_own()
        for part in self._parts():
            part.restore_plain()

    def _release_own(self) -> None:
        for param, linears in self._matrices():
            if linears and all(lin.packed is not None for lin in linears) and not released(param):
                param.data = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
                for i, lin in enumerate(linears):
                    lin.release_weight(param.data if param.dim() == 2 else param.data[i])

    def _restore_own(self) -> None:
        for param, linears in self._matrices():
            if not linears or not released(param) or any(lin.packed is None for lin in linears):
                continue
            self._fill_from_packed(param, linears)

    @staticmethod
    def _fill_from_packed(param: nn.Parameter, linears: list[PreparedLinear]) -> None:
        """``param`` (and each product's ``weight``) from the products' packed copies."""
        if param.dim() == 2:
            param.data = linears[0].unpacked()
            linears[0].weight = param.data
        else:
            param.data = torch.stack([lin.unpacked() for lin in linears])
            for i, lin in enumerate(linears):
                lin.weight = param.data[i]

    @property
    def plain_released(self) -> bool:
        return any(released(param) for param, _ in self._matrices()) or any(
            part.plain_released for part in self._parts())
