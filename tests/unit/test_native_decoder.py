"""The one-call native decoder (``kernels/native_decoder.py``) against the per-layer native path: bitwise."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kernels import native_decoder
from kernels.cpu_native import NativeCpuAttentionBackend
from kernels.kv_quant import KV_CACHE_DTYPES
from kernels.native_ops import native_ops
from kernels.torch_ref import TorchAttentionBackend
from tests.unit.test_model_tiny import NUM_BLOCKS, PagedRunner, hf_model, prompt

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native CPU kernels cannot be built here")

# prefill chunks of two sequences (28 rows), a decode of both, of one, then a chunk beside a decode
STEPS = ([(0, prompt(21, seed=5)), (1, prompt(7, seed=6))], [(0, [3]), (1, [9])], [(0, [4])],
         [(1, prompt(5, seed=7)), (0, [8])])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def spy_calls(runner: PagedRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the row count of every step the one-call decoder runs (it still runs them)."""
    decoder = runner.model.native_decoder
    assert decoder is not None
    calls: list[int] = []
    real = decoder.run

    def run(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return real(hidden, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(decoder, "run", run)
    return calls


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "mqa", "tied", "wide-heads"])
def test_one_call_decoder_is_bitwise_the_per_layer_path(variant: str, threads: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    hf = hf_model(variant)
    steps_alike(PagedRunner(hf), PagedRunner(hf), monkeypatch)  # K/V written to the same slots too


def steps_alike(one_call: PagedRunner, per_layer: PagedRunner, monkeypatch: pytest.MonkeyPatch,
                after_step: Callable[[], None] | None = None) -> None:
    """Run STEPS on ``one_call`` (the one-call decoder, spied) and ``per_layer`` (turned to the per-layer
    path): the same logits and cache bytes after every step (and ``after_step``'s checks), every step in
    one call."""
    per_layer.model.use_native_decoder = False
    calls = spy_calls(one_call, monkeypatch)
    for work in STEPS:
        for got, want in zip(one_call.step(work), per_layer.step(work), strict=True):
            assert torch.equal(got, want)
        assert torch.equal(one_call.kv.view(torch.uint8), per_layer.kv.view(torch.uint8))
        if after_step is not None:
            after_step()
    assert calls == [28, 2, 1, 6]


@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_one_call_decoder_writes_and_reads_a_quantized_cache_as_the_per_layer_path(
        name: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over an int8, fp8 or int4 cache the one call requantizes each touched block and attends as the
    per-layer path does (kernels/cpu_kv_codes.c): the same logits, codes and scales, bit for bit."""
    hf = hf_model("wide-heads")
    dtype = KV_CACHE_DTYPES[name]
    assert dtype is not None
    one_call, per_layer = PagedRunner(hf, kv_dtype=dtype), PagedRunner(hf, kv_dtype=dtype)
    steps_alike(one_call, per_layer, monkeypatch)
    assert one_call.kv_scales is not None and per_layer.kv_scales is not None
    assert torch.equal(one_call.kv_scales, per_layer.kv_scales)
    assert torch.count_nonzero(one_call.kv.view(torch.uint8)) > 0


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_one_call_decoder_scores_blocks_as_the_per_layer_path(name: str, threads: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --kv-eviction (a backend with ``mass``) the one call adds each layer's block scores per KV head
    as the per-layer path does: the same logits, cache and masses, bit for bit, every layer's columns
    filled."""
    hf = hf_model("wide-heads")
    dtype = KV_CACHE_DTYPES["auto" if name == "float32" else name] or torch.float32
    one_call, per_layer = PagedRunner(hf, kv_dtype=dtype), PagedRunner(hf, kv_dtype=dtype)
    width = hf.config.num_hidden_layers * (hf.config.num_key_value_heads or hf.config.num_attention_heads)
    masses = [torch.zeros(NUM_BLOCKS, width), torch.zeros(NUM_BLOCKS, width)]
    for runner, mass in zip((one_call, per_layer), masses, strict=True):
        runner.backend = NativeCpuAttentionBackend(mass=mass)

    def same_masses() -> None:
        assert torch.equal(masses[0], masses[1]) and bool((masses[0].sum(dim=0) > 0).all())

    steps_alike(one_call, per_layer, monkeypatch, same_masses)


def test_one_call_decoder_gives_the_same_bits_on_any_thread_count() -> None:
    """Each output of a native decode step is computed by one thread in one order, so a decode worker
    may run a step on borrowed threads (worker/core_share.py) without changing a token."""
    hf = hf_model("llama3")
    one, two = PagedRunner(hf), PagedRunner(hf)
    before = torch.get_num_threads()
    try:
        for work in STEPS:
            torch.set_num_threads(1)
            got = one.step(work)
            torch.set_num_threads(2)
            want = two.step(work)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
            assert torch.equal(one.kv, two.kv)
    finally:
        torch.set_num_threads(before)


def test_long_prompt_chunks_take_it_with_scratch_for_that_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 70-token prompt chunk beside a decode (blocked and row attention items in one plan) runs in the one
    call too, bitwise; scratch above the kept size is not kept."""
    hf = hf_model("wide-heads")
    runner, reference = PagedRunner(hf), PagedRunner(hf)
    reference.model.use_native_decoder = False
    calls = spy_calls(runner, monkeypatch)
    decoder = runner.model.native_decoder
    assert decoder is not None
    monkeypatch.setattr(native_decoder, "KEEP_WORKSPACE_BYTES", decoder.shape.workspace_floats(8) * 4)
    for work in ([(0, prompt(6, seed=9))], [(1, prompt(70, seed=8)), (0, [5])], [(0, [6]), (1, [7])]):
        for got, want in zip(runner.step(work), reference.step(work), strict=True):
            assert torch.equal(got, want)
        assert torch.equal(runner.kv, reference.kv)
    assert calls == [6, 71, 2]
    assert decoder._work.numel() == decoder.shape.workspace_floats(6)  # the 71-row call's was its own


def test_steps_it_does_not_take() -> None:
    hf = hf_model("llama3")
    runner = PagedRunner(hf)
    runner.step([(0, [5])])
    decoder = runner.model.native_decoder
    assert decoder is not None
    one = torch.zeros(1, hf.config.hidden_size)  # the backend is prepared for the 1-token step
    assert decoder.handles(one, runner.kv, runner.backend, None)
    scales = torch.ones(runner.kv.shape[0], runner.kv.shape[1], 2, runner.kv.shape[4])
    assert not decoder.handles(one, runner.kv, runner.backend, scales)  # a quantized cache's scales
    assert not decoder.handles(one, runner.kv.bfloat16(), runner.backend, None)
    assert not decoder.handles(torch.zeros(2, hf.config.hidden_size), runner.kv, runner.backend, None)
    assert not decoder.handles(one, runner.kv, TorchAttentionBackend(), None)


def test_no_decoder_without_native_products() -> None:
    runner = PagedRunner(hf_model("llama3"))
    assert runner.model.native_decoder is not None
    runner.model.prepare_linears("prepacked")
    assert runner.model.native_decoder is None
    runner.model.prepare_linears("native")
    assert runner.model.native_decoder is not None


def test_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = PagedRunner(hf_model("llama3"))
    runner.model.use_native_decoder = False  # EngineConfig.native_decoder: test_engine_switches.py
    calls = spy_calls(runner, monkeypatch)
    runner.step([(0, [5])])
    assert calls == [] and not runner.model.use_native_decoder
