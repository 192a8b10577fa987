"""Read-thread defaults of the KV sink and the UCX backend parameters they turn into."""

from __future__ import annotations

import pytest

from transfer.agent import READ_THREADS_ENV, default_read_threads, new_agent


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(READ_THREADS_ENV, raising=False)
    return monkeypatch


def test_default_is_two_threads_for_host_memory_on_multicore(cores: pytest.MonkeyPatch) -> None:
    cores.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert default_read_threads("DRAM") == 2
    cores.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert default_read_threads("DRAM") == 2


def test_no_pool_on_one_core_or_gpu_memory(cores: pytest.MonkeyPatch) -> None:
    cores.setattr("os.sched_getaffinity", lambda pid: {3})
    assert default_read_threads("DRAM") == 0
    cores.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert default_read_threads("VRAM") == 0


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("3", 3), (" 1 ", 1)])
def test_environment_overrides(cores: pytest.MonkeyPatch, value: str, expected: int) -> None:
    cores.setenv(READ_THREADS_ENV, value)
    assert default_read_threads("DRAM") == expected
    assert default_read_threads("VRAM") == expected


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_bad_environment_value_names_the_variable(cores: pytest.MonkeyPatch, value: str) -> None:
    cores.setenv(READ_THREADS_ENV, value)
    with pytest.raises(ValueError, match=READ_THREADS_ENV):
        default_read_threads("DRAM")


@pytest.mark.parametrize(
    ("threads", "expected"), [(0, {}), (3, {"num_threads": "3", "split_batch_size": "3"})]
)
def test_ucx_backend_params(threads: int, expected: dict[str, str]) -> None:
    agent = new_agent(f"params-{threads}", "UCX", progress_thread=False, read_threads=threads)
    options = agent.backend_options["UCX"]
    assert {k: options[k] for k in ("num_threads", "split_batch_size") if k in options} == expected
