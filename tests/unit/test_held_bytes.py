"""What the weights hold where kept records take the Triton product (``engine/models/held.py``), against the
engine's own count of a loaded model on that path (``--linear-kernel triton`` under the interpreter), and
``pdserve plan --dtype auto`` reporting it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli.main import main
from engine.llm import LLM
from engine.loader import load_model_source
from engine.models.held import held_bytes
from engine.models.size import parameter_count
from tests.gguf_families import write_q4_k_m
from tests.unit.test_checkpoint_quant import fp8_checkpoint, mxfp4_checkpoint

CHECKPOINTS: dict[str, Callable[[Path], Any]] = {
    "fp8 32x32 blocks": lambda d: fp8_checkpoint(d, "block32"),
    "fp8 channels": lambda d: fp8_checkpoint(d, "channel"),
    "fp8 40x40 blocks (dequantized)": lambda d: fp8_checkpoint(d, "block"),
    "mxfp4 experts": mxfp4_checkpoint,
}


def _engine_and_count(path: Path) -> tuple[int, int, int]:
    """(the loaded model's ``weight_bytes()``, ``held_bytes`` at float32, the float32 model's bytes)."""
    source = load_model_source(path)
    llm = LLM(str(path), linear_kernel="triton", num_kv_blocks=16, block_size=4)
    try:
        held = llm.engine.runner.model.weight_bytes()
    finally:
        llm.close()
    gguf = path if source.kind == "gguf" else None
    counted = held_bytes(source.config, 4, source.quant, gguf).total
    return held, counted, parameter_count(source.config).total * 4


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_held_bytes_are_what_the_engine_holds(tmp_path: Path, name: str) -> None:
    """Equal but for the 4-byte stand-in each matrix kept as records leaves in the model."""
    CHECKPOINTS[name](tmp_path)
    engine, counted, floats = _engine_and_count(tmp_path)
    layers = load_model_source(tmp_path).config.num_layers
    assert 0 <= engine - counted <= 4 * 4 * layers, (engine, counted)
    assert (counted == floats) == ("dequantized" in name)


def test_a_q4_k_m_file_holds_its_k_blocks_and_kmix(tmp_path: Path) -> None:
    """Q4_K and Q6_K matrices as their blocks, layer 0's QKV (Q4_K beside a Q6_K V) as KMIX records."""
    path = write_q4_k_m(tmp_path)
    engine, counted, floats = _engine_and_count(path)
    assert engine - counted == 4 * 4 * 2  # qkv, o, gate/up and down of 2 layers
    assert counted < 0.4 * floats


def test_the_default_gguf_holds_its_blocks(default_model_path: Path) -> None:
    engine, counted, floats = _engine_and_count(default_model_path)
    assert engine - counted == 4 * 4 * 30  # qkv, o, gate/up and down of 30 layers kept as Q4_1 blocks
    assert counted < 0.34 * floats  # the float32 embedding (113 MB) is most of what is left


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_plan_counts_the_records_under_dtype_auto(tmp_path: Path, default_model_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    mxfp4_checkpoint(tmp_path)
    source = load_model_source(tmp_path)
    params = parameter_count(source.config).total
    auto = _plan(capsys, str(tmp_path))
    assert auto["weight_bytes"] == held_bytes(source.config, 2, source.quant).total < 2 * params
    assert auto["kept_records"] and auto["dtype"] == "bfloat16"
    plain = _plan(capsys, str(tmp_path), "--dtype", "bfloat16")
    assert plain["weight_bytes"] == 2 * params and not plain["kept_records"]
    assert auto["active_weight_bytes"] < plain["active_weight_bytes"]
    # the default GGUF: its Q4_1 matrices as blocks, the rest (the embedding above all) in bfloat16
    gguf = _plan(capsys, str(default_model_path))
    config = load_model_source(default_model_path).config
    assert gguf["weight_bytes"] == held_bytes(config, 2, None, default_model_path).total
    tp3 = _plan(capsys, str(default_model_path), "--tensor-parallel-size", "3")
    per_rank = held_bytes(config, 2, None, default_model_path, 3).total
    assert tp3["weight_bytes"] == per_rank < gguf["weight_bytes"]
    assert main(["plan", str(default_model_path)]) == 0
    assert "(bfloat16, quantized matrices as their records)" in capsys.readouterr().out
