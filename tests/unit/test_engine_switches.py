"""The switches that change what the engine computes live in ``EngineConfig`` (and flags): native
kernels, the one-call decoder, the greedy head, the prompt chunks' product. The environment variables
that once set them are deprecated aliases the CLI reads once, where no flag says otherwise."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from cli.engine_args import add_engine_args, engine_config_from_args
from engine.config import EngineConfig
from engine.engine import LLMEngine
from kernels import linear
from kernels.cpu_native import NativeCpuAttentionBackend, native_available
from kernels.torch_ref import TorchAttentionBackend


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


@pytest.mark.skipif(not native_available(), reason="native CPU kernels cannot be built here")
def test_native_kernels_off_runs_torch(tiny_model_dir: Path) -> None:
    on = LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=16))
    assert isinstance(on.runner.backend, NativeCpuAttentionBackend)
    assert on.runner.model.linear_kernel == "native" and on.runner.model.native_decoder is not None
    off = LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=16, native_kernels=False))
    model = off.runner.model
    assert isinstance(off.runner.backend, TorchAttentionBackend)
    assert model.linear_kernel == "prepacked" and not model.use_native_ops and model.native_decoder is None
    assert model.greedy_head is None  # the screen is a native kernel too


def test_decoder_and_greedy_head_switches(tiny_model_dir: Path) -> None:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=16, native_decoder=False,
                                                         greedy_head=False))
    assert not engine.runner.model.use_native_decoder and engine.runner.model.greedy_head is None


def test_large_product_is_set_for_the_process(tiny_model_dir: Path) -> None:
    LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=16, large_product="onednn"))
    assert linear.LARGE_PRODUCT == "onednn"
    LLMEngine(str(tiny_model_dir), EngineConfig(num_kv_blocks=16, large_product="mkl"))
    assert linear.LARGE_PRODUCT == "mkl"
    linear.set_large_product("auto")
    with pytest.raises(ValueError, match="--large-product must be auto, mkl or onednn"):
        EngineConfig(large_product="openblas")


def test_flags_and_deprecated_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    assert parse("--no-native-decoder", "--no-greedy-head", "--large-product", "mkl") == EngineConfig(
        native_decoder=False, greedy_head=False, large_product="mkl")
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    monkeypatch.setenv("PDSERVE_LARGE_PRODUCT", "onednn")
    with caplog.at_level(logging.WARNING):
        config = parse()
    assert not config.native_kernels and config.large_product == "onednn"
    assert "PDSERVE_NATIVE_KERNELS is deprecated: use --native-kernels" in caplog.text
    assert parse("--large-product", "mkl").large_product == "mkl"  # a flag wins over the variable
