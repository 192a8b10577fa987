"""The bytes a model's weights hold where its kept records take the Triton product (a CUDA device under
``--dtype auto``): what ``pdserve plan --dtype auto`` counts as the weights.

The loader keeps these matrices in records (``CausalLM.takes_blocks``, ``kernels/triton_blocks.py``):
dense attention's q/k/v/o, the dense MLP's gate/up/down and every routed expert's three
(``engine.models.size.ParameterCount.kept`` and ``experts``), as

- an fp8 checkpoint's ``FP8`` records, 36 bytes per 32 weights, where its scales cover whole runs of 32
  inputs (per tensor, per channel, or blocks a multiple of 32 wide; others are dequantized);
- an MXFP4 checkpoint's experts as ``Q5_0`` records, 22 bytes per 32 weights;
- a GGUF's matrices as their own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), a fused
  matrix of mixed kinds as ``KMIX`` records.

Everything else (embedding and head, norms, biases, routers, shared experts, latent attention, other
GGUF types) is held at the model dtype, and a family whose loader renames or merges tensors keeps nothing.
With tensor parallelism a rank holds its share of every kept matrix. Checked against the engine's own
``CausalLM.weight_bytes()`` on the Triton path (``tests/unit/test_held_bytes.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint_quant import CheckpointQuant
from engine.config import ModelConfig
from engine.models.gguf_config import one_to_one
from engine.models.registry import family
from engine.models.size import parameter_count
from engine.tensor_parallel import TpShard
from kernels.gguf_blocks import BLOCK_BYTES, BLOCK_INPUTS, QK, BlockKind
from kernels.triton_configs import TRITON_KINDS

FP8_RECORD = BLOCK_BYTES[BlockKind.FP8]
MXFP4_RECORD = BLOCK_BYTES[BlockKind.Q5_0]
# the GGUF tensors the loader hands the model as matrices it keeps (gguf names)
_KEPT_GGUF = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down"
                        r"|ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")
# the parts the model fuses into one matrix (QKV, gate/up; an expert's gate/up)
_FUSED = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "ffn_gate": "gate_up", "ffn_up": "gate_up",
          "ffn_gate_exps": "gate_up_exps", "ffn_up_exps": "gate_up_exps"}


@dataclass(frozen=True)
class Held:
    """One rank's weight bytes, and how many of them are the routed experts' matrices."""

    total: int
    experts: int = 0


def held_bytes(config: ModelConfig, dtype_bytes: int, quant: CheckpointQuant | None = None,
               gguf: Path | None = None, tp: int = 1) -> Held:
    """One rank's weight bytes (module docstring): ``dtype_bytes`` per parameter the model holds as floats;
    ``quant`` the checkpoint's quantization, ``gguf`` the file when the model is one."""
    count = parameter_count(config, TpShard(config, 0, tp))
    dense, experts = count.kept, count.experts  # one rank's parameters the loader may keep in records
    floats = Held(count.total * dtype_bytes, experts * dtype_bytes)
    if not family(config.architecture).passes_blocks:
        return floats
    # (elements, bytes) kept of the dense matrices and of the experts', one rank's
    if gguf is not None:
        whole = _gguf_kept(config, gguf)
        kept_dense, kept_experts = ((n // tp, size // tp) for n, size in (whole[False], whole[True]))
    elif quant is None or (quant.method == "fp8" and quant.block is not None and quant.block[1] % QK):
        return floats  # not quantized, or a run of 32 inputs would span two scales: dequantized
    elif quant.method == "mxfp4":
        kept_dense, kept_experts = (0, 0), (experts, experts * MXFP4_RECORD // QK)
    else:
        kept_dense, kept_experts = (dense, dense * FP8_RECORD // QK), (experts, experts * FP8_RECORD // QK)
    expert_bytes = kept_experts[1] + (experts - kept_experts[0]) * dtype_bytes
    rest = count.total - experts - kept_dense[0]
    return Held(expert_bytes + kept_dense[1] + rest * dtype_bytes, expert_bytes)


def _gguf_kept(config: ModelConfig, path: Path) -> dict[bool, tuple[int, int]]:
    """(elements, bytes) of the file's matrices the model keeps in their blocks: experts' (True) and the
    others' (False), every rank's together. A fused matrix whose parts differ in kind (Q4_K_M's Q and K in
    Q4_K beside a V in Q6_K) is held as ``KMIX`` records, 44 bytes per 32 weights (``kernels/kmix.py``)."""
    from engine.gguf_loader import open_gguf

    kept = {False: (0, 0), True: (0, 0)}
    fmt = family(config.architecture).gguf
    if fmt is None or fmt.merge is not one_to_one:
        return kept
    kinds = {k.name for k in TRITON_KINDS if k != BlockKind.FP8}  # GGML's names for these kinds
    fused: dict[tuple[str, str], list[tuple[str, int, int]]] = {}  # (layer, fused matrix) -> its parts
    for tensor in open_gguf(path).tensors:
        match = _KEPT_GGUF.fullmatch(tensor.name)
        if match is None or tensor.tensor_type.name not in kinds:
            continue
        kind = BlockKind[tensor.tensor_type.name]
        elements = int(tensor.data.nbytes) // BLOCK_BYTES[kind] * BLOCK_INPUTS[kind]
        part = match.group(2)
        fused.setdefault((match.group(1), _FUSED.get(part, part)), []).append(
            (kind.name, elements, int(tensor.data.nbytes)))
    for (_, matrix), parts in fused.items():
        elements = sum(p[1] for p in parts)
        size = (sum(p[2] for p in parts) if len({p[0] for p in parts}) == 1
                else elements // QK * BLOCK_BYTES[BlockKind.KMIX])
        was = kept[matrix.endswith("_exps")]
        kept[matrix.endswith("_exps")] = (was[0] + elements, was[1] + size)
    return kept
