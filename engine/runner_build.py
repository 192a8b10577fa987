"""``build_runner``: one rank's model loaded and its KV cache sized, the runner an ``LLMEngine`` steps.

It resolves ``--dtype auto`` for the model (``EngineConfig.resolve_auto``), builds ``CausalLM`` with the
linear kernel and precisions asked for, loads the weights (a GGUF's blocks and a quantized checkpoint's
codes kept where the model takes them, ``CausalLM.takes_blocks``), hands the C heap's freed pages back,
and sizes the block pool: with tensor parallelism, the smallest any rank's budget buys.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from typing import cast

import torch

from engine.checkpoint_quant import check_flag
from engine.config import EngineConfig
from engine.kv_groups import kv_layout, num_slots
from engine.kv_sizing import num_kv_blocks
from engine.loader import ModelSource
from engine.model_runner import ModelRunner
from engine.models.causal_lm import CausalLM
from engine.tensor_parallel import TpShard
from engine.tp_group import TpGroup
from kernels.linear import LinearKernel, set_large_product
from kernels.native_ops import native_ops

logger = logging.getLogger(__name__)


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): loading leaves the
    float32 temporaries of dequantizing and packing there (125-320 MB of the default model's worker), which
    nothing reuses. A no-op where the C library has no ``malloc_trim``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def build_runner(source: ModelSource, config: EngineConfig, group: TpGroup | None = None) -> ModelRunner:
    """Load this rank's shard of the weights, join the group, size and allocate its KV cache (under
    ``config`` with ``--dtype auto`` resolved for the model: the runner's ``config``).

    Every rank of a group calls this; the block count is the minimum over the ranks, so block ids
    mean the same slots everywhere.
    """
    check_flag(config.quantization, source.kind, source.quant, source.path)
    ops = native_ops() if config.native_kernels else None
    codes = source.quant is not None and source.quant.method in ("fp8", "mxfp4")
    config, why = config.resolve_auto(source.config, ops is not None and ops.bf16_native, codes)
    if why and (group is None or group.rank == 0):
        logger.info(why)
    size = config.tensor_parallel_size
    if size > 1 and (group is None or group.size != size):
        raise ValueError(f"tensor_parallel_size={size} needs a TpGroup of {size} ranks (LLM starts one)")
    shard = TpShard(source.config, group.rank if group is not None else 0, size)
    device = torch.device(config.device)
    if size > 1 and device.type == "cuda" and device.index is None:  # one device per rank (never run yet)
        config = dataclasses.replace(config, device=f"cuda:{shard.rank}")
        torch.cuda.set_device(shard.rank)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    set_large_product(config.large_product)
    native = config.native_kernels
    kernel = cast(LinearKernel, "prepacked" if config.linear_kernel == "native" and not native
                  else config.linear_kernel)
    net = CausalLM(source.config, config.torch_dtype, config.device, kernel, shard, group)
    net.use_native_ops, net.use_native_decoder = native, config.native_decoder
    net.use_greedy_head = config.greedy_head
    net.gguf_activations = config.gguf_activations
    net.bf16_products = config.bf16_products
    # blocks or codes to keep: read whole, each rank cuts its part (a plain checkpoint is read sliced)
    keep = (config.keeps_gguf_blocks and net.takes_blocks
            and (source.kind == "gguf" or source.quant is not None))
    net.load_weights(source.iter_blocks() if keep else source.iter_weights(shard))
    if shard.rank == 0:
        logger.info("%s (%s, %d layers): %s", source.config.name, source.config.architecture,
                    source.config.num_layers, net.execution_path)
    if config.gguf_activations == "int8" and not net.int8_activations:
        logger.warning("--gguf-activations int8: %s keeps no matrix in GGUF blocks; every "
                       "product takes float32 activations", source.config.name)
    return_freed_memory()
    groups = kv_layout(source.config, config.hybrid_kv)
    blocks = num_kv_blocks(shard.kv_config, config, num_slots(groups))
    if group is not None and size > 1:
        group.connect()
        blocks = group.min_int(blocks)
    return ModelRunner(net, source.config, config, blocks, groups)
