"""`pdserve generate` end to end on the built-in model."""

import pytest

from cli.main import main


def test_generate_prints_completion_and_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--max-tokens", "12", "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "output tokens" in out and "tokens/s" in out


def test_generate_rejects_bad_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "/nonexistent/model.gguf", "hi"]) == 2
    assert "pdserve: error:" in capsys.readouterr().err
