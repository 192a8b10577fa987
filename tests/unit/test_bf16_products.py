"""bfloat16 products on CPU (``--dtype bfloat16``, ``kernels/cpu_bf16.c``).

The kernel is compared bitwise with ``bf16_reference``, a torch model of its arithmetic: weights and
activations rounded to bfloat16 (to nearest, ties to even), then one float32 chain per output over the
input pairs in order, ``acc + x[2i+1] w[2i+1]``, then ``+ x[2i] w[2i]`` (each product of two bfloat16
values is exact in float32, so each step is one IEEE rounding on both sides). Served, a tiny model in
bfloat16 stores every product's weight in bfloat16, gives float32's greedy tokens where float32's picks
are not near ties (a dense Llama on the one-call decoder and a mixture of experts per layer), computes
the same bits on every path and chunking, and publishes its numerics for KV transfers.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.hf_loader import read_hf_config as read_model_config
from engine.models.causal_lm import CausalLM
from kernels.linear import PreparedLinear
from kernels.native_ops import BF16_FORMAT, native_ops
from tests.families import agree_up_to_a_near_tie, prompt, save
from transfer.compat import check_compatible, compat_hash
from transfer.errors import IncompatibleKvError
from transfer.wire import WIRE_VERSION, AgentInfo, KvLayout
from worker.tp_kv import rank_layout

_ops = native_ops()
pytestmark = pytest.mark.skipif(_ops is None, reason="no native library here")


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``cpu_bf16.c``'s product of ``x`` ``[m, k]`` and ``weight`` ``[n, k]`` in torch (the module
    docstring)."""
    xb, wb = x.bfloat16().float(), weight.bfloat16().float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for i in range(0, weight.shape[1], 2):
        acc = acc + xb[:, i + 1, None] * wb[None, :, i + 1]
        acc = acc + xb[:, i, None] * wb[None, :, i]
    return acc if bias is None else acc + bias


def test_bf16_products_are_the_reference_bitwise() -> None:
    assert _ops is not None
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(5)
    try:
        # ragged widths; 8192 inputs: chunks of 16 rows (cpu_bf16.c's MC_BYTES), so 40 rows take three
        for out_features, in_features in ((40, 64), (3, 2), (100, 160), (17, 8192)):
            weight = torch.randn(out_features, in_features, generator=gen)
            packed = _ops.pack_bf16(weight)
            assert packed.dtype == torch.int16 and packed.numel() == -(-out_features // 16) * 16 * in_features
            assert torch.equal(_ops.unpack_bf16(packed, out_features), weight.bfloat16().float())
            bias = torch.randn(out_features, generator=gen)
            for rows in (1, 2, 7, 8, 9, 16, 40):
                x = torch.randn(rows, in_features, generator=gen) * 3
                for b in (None, bias):
                    want = bf16_reference(x, weight, b)
                    for n_threads in (1, 2):
                        torch.set_num_threads(n_threads)
                        got = _ops.bf16_linear(x, packed, out_features, b)
                        assert torch.equal(got, want), (out_features, in_features, rows, n_threads)
                    # a row's values alone: the same bits at any row count
                    assert torch.equal(_ops.bf16_linear(x[-1:], packed, out_features, b), want[-1:])
    finally:
        torch.set_num_threads(threads)


def test_bf16_products_round_and_are_close_to_float32() -> None:
    assert _ops is not None
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(64, 256, generator=gen), torch.randn(4, 256, generator=gen)
    linear = PreparedLinear(weight, None, "native")
    want = linear(x)
    assert linear.to_bf16() and linear.bf16 and linear.native_format == BF16_FORMAT
    got = linear(x)
    assert not torch.equal(got, want)
    assert (got - want).norm() < 0.01 * want.norm()
    assert linear.extra_bytes == weight.numel() * 2  # the bfloat16 panels only
    assert torch.equal(linear.unpacked(), weight.bfloat16().float())
    odd = PreparedLinear(torch.randn(16, 33, generator=gen), None, "native")
    assert not odd.to_bf16() and not odd.bf16  # an odd input width keeps the float32 product
    with pytest.raises(ValueError, match="even input width"):
        _ops.pack_bf16(torch.zeros(16, 33))


def test_cpu_bfloat16_is_bf16_products_over_float32_activations() -> None:
    cfg = EngineConfig(dtype="bfloat16")
    assert cfg.bf16_products and cfg.torch_dtype == torch.float32 and cfg.kv_torch_dtype == torch.float32
    for other in (EngineConfig(dtype="bfloat16", native_kernels=False),
                  EngineConfig(dtype="bfloat16", linear_kernel="prepacked")):
        assert not other.bf16_products and other.torch_dtype == torch.bfloat16  # torch's bfloat16 model
    assert not EngineConfig().bf16_products and not EngineConfig(dtype="float32").bf16_products
    with pytest.raises(ValueError, match="--compile-cpu"):
        EngineConfig(dtype="bfloat16", compile_cpu=True)


def test_bf16_numerics_are_part_of_transfer_compatibility() -> None:
    layout = KvLayout("m", "float32", 2, 8, 16, 2, 16, 4)
    bf16 = msgspec.structs.replace(layout, numerics="bf16")
    assert compat_hash(bf16) != compat_hash(layout)
    with pytest.raises(IncompatibleKvError, match="numerics"):
        check_compatible(layout, AgentInfo(WIRE_VERSION, compat_hash(bf16), "peer", b"", 0, 0, "DRAM", bf16))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models (heads scaled by ``tests.families.HEAD_SCALE``): a Llama and a Qwen3 MoE."""
    root = tmp_path_factory.mktemp("bf16")
    for family in ("llama", "qwen3_moe"):
        save(family, root / family)
    return {family: root / family for family in ("llama", "qwen3_moe")}


def _model(llm: LLM) -> CausalLM:
    return llm.engine.runner.model


Run = list[tuple[list[int], list[list[tuple[int, float]]]]]
PROMPTS = [prompt(3 + 7 * seed % 40, seed) for seed in range(16)]
MARGIN = 0.5  # logprob gap of the float32 picks compared (bfloat16's logprobs stay within ~0.1 here)


def _run(llm: LLM) -> Run:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, logprobs=2))
    return [(o.token_ids, [t.top for t in o.logprobs or [] if t is not None]) for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_served_bf16_model_picks_the_float32_tokens_away_from_ties(folders: dict[str, Path],
                                                                   family: str) -> None:
    bf16 = LLM(str(folders[family]), num_threads=2, dtype="bfloat16")
    floats = LLM(str(folders[family]), num_threads=2, dtype="float32")
    try:
        model = _model(bf16)
        assert model.bf16_products and "bfloat16 products" in model.execution_path
        if family == "llama":
            assert model.execution_path.startswith("one native call per step")
        routers = [id(layer.mlp.router_linear) for layer in model.decoder_layers()
                   if hasattr(layer.mlp, "router_linear")]
        assert bool(routers) == (family == "qwen3_moe")
        for lin in model.prepared_linears():  # every product, the LM head's too, but a router's
            assert lin.bf16 == (id(lin) not in routers)
        assert model.greedy_head is None  # the bfloat16 head is its own screen's size
        assert model.weight_bytes() < 0.75 * _model(floats).weight_bytes()
        assert rank_layout(bf16.engine.runner, "m").numerics == "bf16"
        assert rank_layout(bf16.engine.runner, "m").dtype == "float32"  # the KV cache stays float32
        got, want = _run(bf16), _run(floats)
        assert got != want  # another arithmetic
        compared = sum(agree_up_to_a_near_tie(tokens, float_tokens, tops, MARGIN)
                       for (tokens, _), (float_tokens, tops) in zip(got, want, strict=True))
        assert compared >= 20
        if family == "llama":  # the per-layer path computes the one-call decoder's bits
            model.use_native_decoder = False
            assert _run(bf16) == got
    finally:
        bf16.close()
        floats.close()


def test_bf16_prompt_chunks_compute_the_decode_steps_bits(folders: dict[str, Path]) -> None:
    """A product's value depends on its row only: a prompt fed 5 tokens a step gives the bits of one chunk."""
    whole = LLM(str(folders["llama"]), num_threads=2, dtype="bfloat16")
    try:
        want = _run(whole)
    finally:
        whole.close()
    chunked = LLM(str(folders["llama"]), num_threads=1, dtype="bfloat16", max_num_batched_tokens=5,
                  enable_prefix_caching=False)
    try:
        assert _run(chunked) == want
    finally:
        chunked.close()


def test_auto_takes_bf16_products_for_a_bfloat16_checkpoint(folders: dict[str, Path], tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """``--dtype auto`` on CPU: a checkpoint whose config.json names bfloat16 runs the bfloat16 products
    where the CPU has AVX512-BF16, and says so; a float32 one, or an explicit dtype, stays as it is."""
    folder = tmp_path / "bf16-checkpoint"
    shutil.copytree(folders["llama"], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16"}))
    model = read_model_config(folder)
    assert model.checkpoint_dtype == "bfloat16"
    assert read_model_config(folders["llama"]).checkpoint_dtype == "float32"
    auto = EngineConfig()
    resolved, why = auto.resolve_auto(model, cpu_runs_bf16=True)
    assert resolved.dtype == "bfloat16" and resolved.bf16_products and "AVX512-BF16" in why
    kept = ((auto, False), (EngineConfig(dtype="float32"), True), (EngineConfig(native_kernels=False), True),
            (EngineConfig(compile_cpu=True), True))
    for config, runs_bf16 in kept:
        assert config.resolve_auto(model, runs_bf16) == (config, "")
    assert auto.resolve_auto(read_model_config(folders["llama"]), True) == (auto, "")
    if _ops is None or not _ops.bf16_native:
        pytest.skip("this CPU has no AVX512-BF16: --dtype auto stays float32")
    with caplog.at_level(logging.INFO, logger="engine.runner_build"):
        llm = LLM(str(folder), num_threads=2)
    try:
        assert llm.engine.config.dtype == "bfloat16" and _model(llm).bf16_products
        assert "the checkpoint is bfloat16" in caplog.text
    finally:
        llm.close()
    floats = LLM(str(folder), num_threads=2, dtype="float32")
    try:
        assert not _model(floats).bf16_products
    finally:
        floats.close()
