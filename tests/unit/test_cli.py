from __future__ import annotations

import pytest

from cli.engine_args import parse_size
from cli.main import UsageError, main

GENERATE_FLAGS = (
    "--model", "--dtype", "--device", "--block-size", "--kv-cache-memory", "--num-kv-blocks",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--max-num-batched-tokens", "--max-num-seqs",
    "--max-model-len", "--seed", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p",
    "--presence-penalty", "--frequency-penalty", "--repetition-penalty", "--ignore-eos",
    "--chat", "--no-chat", "--kv-cache-dtype", "--preemption-mode", "--swap-space", "--kv-offload-bytes",
    "--kv-offload-dir", "--kv-window", "--kv-sinks",
)


def test_top_level_help_lists_generate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: pdserve" in out
    assert "generate" in out


def test_generate_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in GENERATE_FLAGS:
        assert flag in out, flag


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--block-size", "3"], "--block-size"),
        (["--kv-cache-memory", "abc"], "--kv-cache-memory"),
        (["--dtype", "int7"], "--dtype"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks"),
        (["--device", "tpu"], "--device"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--min-p", "1.5"], "--min-p"),
        (["--top-k", "-2"], "--top-k"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
        (["--preemption-mode", "drop"], "--preemption-mode"),
        (["--kv-window", "0"], "--kv-window"),
        (["--kv-sinks", "4"], "--kv-sinks"),
        (["--kv-offload-bytes", "lots"], "--kv-offload-bytes"),
    ],
)
def test_bad_flag_exits_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *argv, "hello"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pdserve: error: ")
    assert flag in lines[0]
    assert "Traceback" not in err


def test_missing_prompt_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate"]) == 2
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("pdserve: error: ") == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1048576),
        ("512M", 512 * 2**20),
        ("512m", 512 * 2**20),
        ("2G", 2 * 2**30),
        ("2GiB", 2 * 2**30),
        ("2GB", 2 * 2**30),
        ("64K", 64 * 1024),
        ("1.5G", 3 * 2**29),
        ("1T", 2**40),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "12X", "0", "G", "1.2.3M"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_offload_bytes_zero_means_off_but_other_sizes_reject_zero() -> None:
    from cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--kv-offload-bytes", "0", "hello"])
    assert args.kv_offload_bytes == 0
    assert parse_size("0", allow_zero=True) == 0
    with pytest.raises(UsageError, match="--kv-cache-memory: invalid size '0'; must be at least 1 byte"):
        parser.parse_args(["generate", "--kv-cache-memory", "0", "hello"])
