"""Shared fixtures and markers for every test folder."""

from __future__ import annotations

import json
import os
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
    engine are compared with. Loaded once per session.

    transformers dequantizes the GGUF in ~23 s; what it produced is kept (``_reference_folder``: keyed by
    the file and the transformers and gguf versions) and read back in ~2 s by later sessions, so the
    reference stays transformers' own reading of the file, never ours."""
    return load_transformers_reference(default_model_path)


def load_transformers_reference(gguf_path: Path) -> Any:
    """transformers' float32 model of ``gguf_path``: the stored one when there is one, else loaded by
    transformers from the GGUF and stored (what ``transformers_default_model`` returns, for a module
    that cannot share that fixture)."""
    from transformers import AutoModelForCausalLM

    folder = _reference_folder(gguf_path)
    stored = _read_reference(folder)
    if stored is not None:
        return stored
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True,
    ).eval()
    _write_reference(folder, model)
    return model


def _reference_folder(gguf_path: Path) -> Path:
    from importlib.metadata import version

    from engine.loader import cache_root

    stat = gguf_path.stat()
    key = (f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{version('transformers')}"
           f"-gguf{version('gguf')}")
    return cache_root() / "test-references" / key


def _read_reference(folder: Path) -> Any | None:
    """The stored reference (``_write_reference``), or None when there is none (or it does not load)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    if not (config_path.is_file() and weights_path.is_file()):
        return None
    try:
        config = AutoConfig.for_model(**json.loads(config_path.read_text()))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        result = model.load_state_dict(load_file(weights_path), strict=False)
    except (OSError, ValueError, RuntimeError):
        return None
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) != tied:
        return None
    return model.eval()


def _write_reference(folder: Path, model: Any) -> None:
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = f".{os.getpid()}.tmp"
    save_file(weights, folder / f"model.safetensors{suffix}")
    (folder / f"config.json{suffix}").write_text(json.dumps(config))
    os.replace(folder / f"model.safetensors{suffix}", folder / "model.safetensors")
    os.replace(folder / f"config.json{suffix}", folder / "config.json")


# fixtures that start Ray: the session's Ray in this process, a `pdserve serve` subprocess (on that Ray or
# its own), or a multi-node Ray cluster
RAY_FIXTURES = frozenset({"ray_session", "pdserve_factory", "pdserve_server", "ray_cluster"})


# `pytest -n 2` (the default, see pyproject.toml) runs each module on one worker process, and the modules
# sharing a session fixture too expensive to build twice together on one, in collection order. (pytest-xdist's
# own `--dist loadgroup` cannot tag node ids under pytest 9, so the scheduler below groups by path.)
SHARED_SCOPES = {
    "default-server": ("pdserve_server", (  # one `pdserve serve` on one Ray session
        "tests/integration/test_bench.py", "tests/integration/test_observability.py",
        "tests/integration/test_openai_api.py", "tests/integration/test_request_fields.py",
        "tests/integration/test_structured.py", "tests/integration/test_structured_migration.py",
        "tests/integration/test_worker_env.py")),
    "transformers-reference": ("transformers_default_model", (  # the model transformers loads from the GGUF
        "tests/integration/test_engine_vs_hf.py", "tests/unit/test_loaders.py")),
    # no shared fixture: the modules that start many worker processes (kills, restarts, rank groups) run
    # one after another on one xdist worker, never beside each other, so that the timing bounds of one
    # (e.g. the disconnect storm's 60 s to free everything) never meet the other's load on 2 cores
    "worker-heavy": ("", (
        "tests/integration/test_resilience.py", "tests/integration/test_chaos.py",
        "tests/integration/test_tp_serve.py", "tests/integration/test_tensor_parallel.py")),
}
_SCOPE_OF_MODULE = {m: scope for scope, (_, modules) in SHARED_SCOPES.items() for m in modules}


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: its shared scope, else its module."""
    module = nodeid.split("::", 1)[0]
    return _SCOPE_OF_MODULE.get(module, module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SharedScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return SharedScopeScheduling(config, log)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark a test ``ray`` when it uses a Ray-starting fixture; a test that uses a shared session fixture
    from a module ``SHARED_SCOPES`` does not list fails (it would build the fixture again elsewhere)."""
    fixturenames = getattr(item, "fixturenames", ())
    if RAY_FIXTURES.intersection(fixturenames):
        item.add_marker(pytest.mark.ray)
    module = item.nodeid.split("::", 1)[0]
    for scope, (fixture, modules) in SHARED_SCOPES.items():
        if fixture in fixturenames and module not in modules:
            item.stash[_MISPLACED] = (f"{item.nodeid} uses {fixture}: add {module} to "
                                      f"SHARED_SCOPES[{scope!r}] in tests/conftest.py")


_MISPLACED = pytest.StashKey[str]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _MISPLACED in item.stash:
        pytest.fail(item.stash[_MISPLACED])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is present."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
