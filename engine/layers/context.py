"""``LayerContext``: what every layer of a model is built with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.tensor_parallel import TpShard
from engine.tp_group import TpGroup

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class LayerContext:
    """The model's config, dtype and device, this rank's ``shard`` and its ``group`` (None on one rank),
    and the family's RMSNorm (``kernels.norm.rms_norm``, or ``rms_norm_offset`` for Gemma's ``1 + w``)."""

    config: ModelConfig
    dtype: torch.dtype
    device: torch.device | str
    shard: TpShard
    group: TpGroup | None
    norm: NormFn

    @property
    def rank0(self) -> bool:
        """Whether this rank adds the row-parallel biases (one rank of the group does)."""
        return self.shard.rank == 0

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel product's partial results over the group (as it is on one rank)."""
        return self.group.all_reduce(x) if self.group is not None else x
