"""How ``CausalLM`` takes its weights: Hugging Face-named tensors into its parameters, and a loader's GGUF
blocks and checkpoint codes (``kernels.gguf_blocks.BlockMatrix``) kept where the model's products read
them (``takes_blocks``). A mixin of ``CausalLM``, which owns everything it reads (the annotations below);
the contract of ``load_weights`` is in ``engine/models/causal_lm.py``'s docstring.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.decoder import DecoderLayer
from engine.layers.prepared import Prepared, released
from engine.models.block_pieces import BlockPieces
from engine.models.family import ModelFamily
from engine.tensor_parallel import TpShard
from kernels.gguf_blocks import BlockMatrix, BlockStack
from kernels.linear import LinearKernel, triton_blocks_usable
from kernels.native_ops import native_ops

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightLoading:
    """``load_weights`` and the keeping of blocks; see the module docstring."""

    config: ModelConfig
    family: ModelFamily
    shard: TpShard
    dtype: torch.dtype
    linear_kernel: LinearKernel
    embed_tokens: nn.Parameter
    lm_head: nn.Parameter
    norm: nn.Parameter
    embed_blocks: BlockMatrix | None
    head_blocks: BlockMatrix | None

    def decoder_layers(self) -> list[DecoderLayer]:
        raise NotImplementedError

    def prepare_linears(self, kernel: LinearKernel | None = None) -> None:
        raise NotImplementedError

    @property
    def takes_blocks(self) -> bool:
        """Whether ``load_weights`` keeps GGUF blocks (``kernels.gguf_blocks.BlockMatrix``) as they come:
        float32 CPU weights with the native product, or the Triton product's device (``triton_products``),
        for a family whose ``canonical`` passes blocks on (``ModelFamily.passes_blocks``). With tensor
        parallelism each rank cuts its part of a matrix from the whole blocks (``BlockMatrix.narrow``: its
        rows, or its inputs at block boundaries); the embedding and head, and matrices a rank's cut splits
        inside a block, are dequantized. Blocks it does not keep (other matrices, or when this is False)
        are dequantized."""
        if self.triton_products:
            return self.family.passes_blocks
        return (self.dtype == torch.float32 and self.linear_kernel == "native"
                and self.family.passes_blocks and native_ops() is not None
                and self.embed_tokens.device.type == "cpu")

    @property
    def triton_products(self) -> bool:
        """Whether kept blocks take the Triton product (``kernels/triton_blocks.py``): on CUDA, and for
        ``linear_kernel="triton"`` under the interpreter. The embedding and head are dequantized then."""
        return triton_blocks_usable(self.embed_tokens.device, self.linear_kernel)

    def _block_targets(self) -> dict[str, tuple[Prepared, str, int, int | None]]:
        found: dict[str, tuple[Prepared, str, int, int | None]] = {}
        for i, layer in enumerate(self.decoder_layers()):
            found |= layer.block_targets(f"model.layers.{i}")
        return found

    def _take_blocks(self, name: str, matrix: BlockMatrix,
                     block_targets: dict[str, tuple[Prepared, str, int, int | None]],
                     pieces: BlockPieces) -> bool:
        """Keep ``matrix`` for ``name`` in its blocks (the embedding, the head, dense attention's, the MLP's
        and the experts' matrices; a fused one's parts gathered in ``pieces``), or say it is not taken."""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            if self.shard.size > 1 or self.triton_products:  # a rank's vocabulary rows take floats (the
                return False  # lookups mask the others); the Triton path looks up and multiplies floats
            if name == "model.embed_tokens.weight":
                self.embed_blocks = matrix
            if name == "lm_head.weight" or self.config.tie_word_embeddings:
                self.head_blocks = matrix
            return True
        found = block_targets.get(name)
        if found is None:
            return False
        module, attr, row, expert = found
        pieces.add(module, attr, row, name, matrix, expert)
        return True

    def _drop_embedding_blocks(self) -> None:
        """Before a load: the embedding and head take floats again unless blocks arrive."""
        for param in (self.embed_tokens, self.lm_head):
            if released(param):
                param.data = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        self.embed_blocks = self.head_blocks = None

    def _hf_targets(self) -> dict[str, torch.Tensor]:
        start, stop = self.shard.vocab_range
        targets = {"model.embed_tokens.weight": self.embed_tokens.data[: stop - start],
                   "model.norm.weight": self.norm.data}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head.data[: stop - start]
        for i, layer in enumerate(self.decoder_layers()):
            targets.update(layer.hf_targets(f"model.layers.{i}"))
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockMatrix | BlockStack]]) -> None:
        """Copy Hugging Face-named tensors in, cast to the model dtype.

        Raises ``ValueError`` naming the first unexpected, duplicated or
        mis-shaped parameter, or every missing one. With tied embeddings a
        ``lm_head.weight`` is accepted and ignored (state dicts carry it). A ``BlockMatrix`` is kept in its
        blocks where ``takes_blocks`` and the matrix can (``_take_blocks``), dequantized anywhere else.
        """
        self._drop_embedding_blocks()
        targets = self._hf_targets()
        block_targets = self._block_targets() if self.takes_blocks else {}
        pieces = BlockPieces()
        loaded: set[str] = set()
        # families that rename or split tensors get floats only unless their canonical passes blocks on
        # (``takes_blocks``); a BlockStack comes out split into BlockMatrix experts
        named = cast(Iterable[tuple[str, torch.Tensor | BlockMatrix]],
                     self.family.canonical(cast(Iterable[tuple[str, torch.Tensor]], weights), self.config))
        for name, tensor in named:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"unexpected parameter {name!r} for a {self.config.architecture} model")
            if name in loaded:
                raise ValueError(f"parameter {name!r} given twice")
            cut = self.shard.weight_slice(name) if self.shard.size > 1 else None
            if isinstance(tensor, BlockMatrix):
                part = (tensor.narrow(cut.dim, cut.start, cut.stop)
                        if cut is not None and tuple(tensor.shape) != tuple(target.shape) else tensor)
                fits = part is not None and tuple(part.shape) == tuple(target.shape)
                if part is not None and fits and self._take_blocks(name, part, block_targets, pieces):
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            if (cut is not None and tuple(tensor.shape) != tuple(target.shape) and tensor.dim() > cut.dim
                    and tensor.shape[cut.dim] >= cut.stop):  # a whole tensor: cut this rank's part
                tensor = cut.take(tensor)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"missing parameters: {shown}")
        pieces.finish(targets)
        self.prepare_linears()
