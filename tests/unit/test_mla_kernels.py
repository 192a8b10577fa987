"""The absorbed form's kernels (``kernels/cpu_mla.c`` natively, ``kernels/triton_mla.py`` interpreted)
against the torch reference and against the expanded form, on the same paged latent cache.

Tolerances, relative to the output's largest magnitude: 2e-5 where the kernels read the same float32
values as the reference (float32 caches, and every quantized cache, whose codes both dequantize to the
same float32 values with the same block scale); a bfloat16 cache is read exactly by all of them (its
rows are widened, not rounded), so 2e-5 there too against the reference, and the bfloat16 cache against
the float32 one that produced it within 2e-2 (the rounding of the latents when written). Only the order
of the sums differs between the kernels and the reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.attention import AttentionMetadata
from kernels.cpu_native import native_available
from kernels.kv_quant import SCALED_DTYPES, code_values  # int4 stores no latent cache
from kernels.mla import MlaTorchBackend
from kernels.mla_backends import MlaNativeBackend, MlaTritonBackend, mla_backend

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler for the native kernels")

BS = 16
Factory = Callable[[bool | None], MlaTorchBackend]
BACKENDS: dict[str, Factory] = {
    "native": lambda absorb: MlaNativeBackend(absorb),
    "native-2-threads": lambda absorb: MlaNativeBackend(absorb, num_threads=2),
    "triton": lambda absorb: MlaTritonBackend(torch.float32, absorb),
}


def _step(backend: MlaTorchBackend, meta: AttentionMetadata, cache: torch.Tensor, scales: torch.Tensor | None,
          w: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    heads, nope, rank = w["uk"].shape
    rope = cache.shape[-1] - rank
    q_nope = torch.randn(meta.num_tokens, heads, nope, generator=g)
    q_rope = torch.randn(meta.num_tokens, heads, rope, generator=g)
    latent = torch.randn(meta.num_tokens, rank + rope, generator=g) * 2
    backend.prepare(meta)
    return backend.forward(q_nope, q_rope, latent, cache, w["uk"], w["uv"], 0.25, scales)


def _decode(make: Factory, dtype: torch.dtype, shape: tuple[int, int, int],
            absorb: bool | None = None) -> torch.Tensor:
    """Two prompts written by the expanded form, then one decode row each (absorbed unless forced);
    ``cache`` and ``scales`` fresh per call, so every backend sees the same writes. ``shape``: heads,
    latent rank, rotary width."""
    heads, rank, rope = shape
    g = torch.Generator().manual_seed(1)
    w = {"uk": torch.randn(heads, 16, rank, generator=g) / rank**0.5,
         "uv": torch.randn(heads, 24, rank, generator=g) / rank**0.5}
    cache = torch.zeros(24, 1, BS, 1, rank + rope, dtype=dtype)
    scales = torch.ones(24, 1, 1) if dtype in SCALED_DTYPES else None
    tables = [[7, 2, 19, 4, 11], [13, 0, 22]]
    prompts = AttentionMetadata.build(BS, [70, 33], [70, 33], tables)
    _step(MlaTorchBackend(False), prompts, cache, scales, w, 2)
    return _step(make(absorb), AttentionMetadata.build(BS, [1, 1], [71, 34], tables), cache, scales, w, 3)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    scale = float(ref.abs().max())
    assert scale > 0
    err = float((out.float() - ref.float()).abs().max())
    assert err <= tol * scale, f"max error {err:.3g} > {tol} x {scale:.3g}"


def _no_reference(*args: object) -> torch.Tensor:
    raise AssertionError("a decode row fell back to the torch reference")


@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, *SCALED_DTYPES], ids=str)
def test_the_kernels_equal_the_reference_and_the_expanded_form(name: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Odd widths (rank 40 + rope 8: neither a whole vector) and 5 heads (a partial head block)."""
    shape = (5, 40, 8)  # heads, rank, rope
    with monkeypatch.context() as patch:
        patch.setattr(MlaTorchBackend, "mix", _no_reference)  # the kernel runs, not the reference
        out = _decode(BACKENDS[name], dtype, shape)
    _close(out, _decode(lambda a: MlaTorchBackend(a), dtype, shape), 2e-5)
    _close(out, _decode(lambda a: MlaTorchBackend(a), dtype, shape, absorb=False), 2e-5)
    if dtype == torch.bfloat16:  # the rounding of the latents when written
        _close(out, _decode(lambda a: MlaTorchBackend(a), torch.float32, shape, absorb=False), 2e-2)


def test_deepseek_width_natively_and_every_thread_count_alike() -> None:
    """DeepSeek's latent (512 + 64) and 16 heads: the native kernel equals the reference, and its bits do
    not depend on the thread count (a head's sums are its own)."""
    shape = (16, 512, 64)
    one = _decode(lambda a: MlaNativeBackend(a, num_threads=1), torch.bfloat16, shape)
    two = _decode(lambda a: MlaNativeBackend(a, num_threads=2), torch.bfloat16, shape)
    assert torch.equal(one, two)
    _close(one, _decode(lambda a: MlaTorchBackend(a), torch.bfloat16, shape), 2e-5)


def test_code_values_are_the_reference_dequantization() -> None:
    for dtype in SCALED_DTYPES:
        values = code_values(dtype)
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        torch.testing.assert_close(values, codes.float(), rtol=0, atol=0, equal_nan=True)


def test_the_backend_is_chosen_per_device_and_flag() -> None:
    assert type(mla_backend("cpu")) is MlaNativeBackend
    assert type(mla_backend("cpu", native_kernels=False)) is MlaTorchBackend
    assert type(mla_backend("cpu", "torch")) is MlaTorchBackend
    assert type(mla_backend("cpu", "triton")) is MlaTritonBackend  # interpreted here (tests/conftest.py)
    with pytest.raises(ValueError, match="attention_backend"):
        mla_backend("cpu", "bogus")


def test_the_bench_writes_its_section_and_refuses_bad_flags(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``bench.lab.mla_attention`` times both backends and writes its section between its markers."""
    from bench.lab import mla_attention

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    assert mla_attention.main(["--batches", "2", "--contexts", "40", "--dtypes", "bfloat16", "--repeats", "1",
                               "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert mla_attention.BEGIN in text and mla_attention.END in text and "A smoke run" in text
    assert "| 2 | 40 | bfloat16 |" in text
    for flags, message in ((["--dtypes", "float16"], "--dtypes"), (["--repeats", "0"], "--repeats"),
                           (["--contexts", "0"], "--contexts")):
        with pytest.raises(SystemExit):
            mla_attention.parse(flags)
        assert message in capsys.readouterr().err
