"""``bench.lab.mla_step``'s model is DeepSeek-V2-Lite-shaped: at its 27 layers the engine counts the
published 15.7 B parameters, and 2.66 B active per token with both vocabulary tables (the published 2.4 B
is the layers and the LM head, 2.45 B); fewer layers keep every width. Bad flags are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.lab.mla_step import V2_LITE, parse, v2_lite
from cli.plan import read_model_config
from engine.models.size import parameter_count


def _count(layers: int, tmp_path: Path) -> tuple[float, float]:
    (tmp_path / "config.json").write_text(json.dumps(v2_lite(layers)))
    count = parameter_count(read_model_config(tmp_path / "config.json"))
    return count.total / 1e9, count.active / 1e9


def test_at_27_layers_the_published_sizes(tmp_path: Path) -> None:
    total, active = _count(27, tmp_path)
    assert round(total, 1) == 15.7
    # by hand: a mixture layer is 64 + 2 shared experts of 3 x 2048 x 1408, a router, and latent attention
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048
    expert, norms, tables = 3 * 2048 * 1408, 2 * 2048, 102400 * 2048
    mixture = 66 * expert + 64 * 2048 + attention + norms
    dense = 3 * 2048 * 10944 + attention + norms
    assert total * 1e9 == pytest.approx(dense + 26 * mixture + 2 * tables + 2048, rel=1e-9)
    active_mixture = mixture - 58 * expert  # 6 routed + 2 shared of the 66
    assert active * 1e9 == pytest.approx(dense + 26 * active_mixture + 2 * tables + 2048, rel=1e-9)
    assert round(active - tables / 1e9, 2) == 2.45


def test_fewer_layers_keep_every_width(tmp_path: Path) -> None:
    config = read_model_config(_write(tmp_path, v2_lite(3)))
    assert config.num_layers == 3 and config.mla is not None and config.mla.latent_dim == 576
    assert config.moe is not None and (config.moe.num_experts, config.moe.top_k) == (64, 6)
    assert {k: v for k, v in v2_lite(3).items() if k != "num_hidden_layers"} == V2_LITE


def _write(folder: Path, fields: dict[str, object]) -> Path:
    (folder / "config.json").write_text(json.dumps(fields))
    return folder / "config.json"


BAD = [(["--layers", "1"], "--layers"), (["--batches", "0"], "--batches"), (["--repeats", "0"], "--repeats")]


@pytest.mark.parametrize(("argv", "flag"), BAD)
def test_bad_flags_are_named(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert flag in capsys.readouterr().err
