"""Shared fixtures and markers for every test folder."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton kernels run on CPU tensors through its interpreter, which must be chosen before
# triton is first imported (transformers may import it): so here, before any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the test process, as in every worker (``--torch-threads 1``): the shapes here are
# tiny, and a second OpenMP thread spinning beside the workers and servers this session runs on the same
# two cores made reference generation 4x slower, not faster.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The built-in SmolLM2-135M-Instruct GGUF; fails loudly when the set-up step was skipped."""
    from engine.loader import default_model_path as engine_default_model_path

    path = Path(engine_default_model_path())
    if not path.is_file():
        pytest.fail(f"default model not found at {path}; fetch it with `python scripts/fetch_model.py`")
    return path


@pytest.fixture(scope="session")
def transformers_default_model(default_model_path: Path) -> Any:
    """The built-in GGUF loaded by transformers itself (float32, eval): the reference our loader and
    engine are compared with. Loaded once per session (it takes seconds)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32,
        local_files_only=True,
    ).eval()


# fixtures that start Ray: the session's Ray in this process, a `pdserve serve` subprocess (on that Ray or
# its own), or a multi-node Ray cluster
RAY_FIXTURES = frozenset({"ray_session", "pdserve_factory", "pdserve_server", "ray_cluster"})


# `pytest -n 2 --dist loadgroup` (the default, see pyproject.toml) runs each group on one worker process,
# in collection order, so a session fixture the group shares is built once: the first rule that matches
# a test's fixtures names its group; tests that match none are dealt out one by one.
XDIST_GROUPS = (
    ("ray-servers", frozenset({"pdserve_server", "pdserve_factory"})),  # `pdserve serve` subprocesses
    ("ray-actors", frozenset({"ray_session", "ray_cluster"})),  # actors on the session's Ray; a cluster
    ("transformers-reference", frozenset({"transformers_default_model"})),
)


def xdist_group(fixturenames: Iterable[str]) -> str | None:
    names = set(fixturenames)
    return next((group for group, fixtures in XDIST_GROUPS if fixtures & names), None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses a Ray-starting fixture ``ray``; put tests in their ``XDIST_GROUPS``
    group; skip ``@pytest.mark.gpu`` tests when no CUDA device is present."""
    for item in items:
        fixturenames = getattr(item, "fixturenames", ())
        if RAY_FIXTURES.intersection(fixturenames):
            item.add_marker(pytest.mark.ray)
        group = xdist_group(fixturenames)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
