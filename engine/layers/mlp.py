"""``GatedMLP``: the dense MLP, ``down(act(gate(x)) * up(x))``.

Weights (Hugging Face names under ``<layer>.mlp``): ``gate_proj`` and ``up_proj`` fused into one
``gate_up`` matrix (rows: gate, then up; this rank's columns of the intermediate size), ``down_proj``
(row-parallel, summed over the group). ``act`` is SiLU or tanh-GELU (``ModelConfig.hidden_act``).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.context import LayerContext
from engine.layers.prepared import Prepared, weight
from kernels.activation import gated_activation
from kernels.linear import LinearKernel, PreparedLinear


class GatedMLP(Prepared):
    def __init__(self, ctx: LayerContext, intermediate_size: int) -> None:
        super().__init__()
        c = ctx.config
        self.ctx = ctx
        self.act_name = c.hidden_act
        self.act = gated_activation(c.hidden_act)
        self.gate_up = weight(2 * intermediate_size, c.hidden_size, dtype=ctx.dtype, device=ctx.device)
        self.down_proj = weight(c.hidden_size, intermediate_size, dtype=ctx.dtype, device=ctx.device)
        self.prepare_linears("plain")

    def _build_linears(self, kernel: LinearKernel) -> None:
        self.gate_up_linear = PreparedLinear(self.gate_up, None, kernel, self.blocks("gate_up"))
        self.down_linear = PreparedLinear(self.down_proj, None, kernel, self.blocks("down_proj"))

    def _matrices(self) -> list[tuple[nn.Parameter, list[PreparedLinear]]]:
        return [(self.gate_up, [self.gate_up_linear]), (self.down_proj, [self.down_linear])]

    def block_targets(self, prefix: str) -> dict[str, tuple[str, int]]:
        """Hugging Face name -> (matrix, first row) for the matrices that take GGUF blocks."""
        inter = self.gate_up.shape[0] // 2
        return {f"{prefix}.gate_proj.weight": ("gate_up", 0), f"{prefix}.up_proj.weight": ("gate_up", inter),
                f"{prefix}.down_proj.weight": ("down_proj", 0)}

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        self.restore_plain()
        inter = self.gate_up.shape[0] // 2
        return {f"{prefix}.gate_proj.weight": self.gate_up.data[:inter],
                f"{prefix}.up_proj.weight": self.gate_up.data[inter:],
                f"{prefix}.down_proj.weight": self.down_proj.data}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.reduce(self.down_linear(self.act(self.gate_up_linear(x))))
