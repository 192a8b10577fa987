"""New families served disaggregated over HTTP, one of each new KV kind: ``pdserve serve`` with one
prefill and one decode worker (KV handed over NIXL) answers transformers' greedy tokens, token for token,
for Gemma 3 (KV groups with sliding windows) and DeepSeek-V3 (the latent cache). Every family's handoff
between real workers, gpt-oss's sinks and sliding groups included, is checked in one process
(``test_families_disagg.py``).

The servers start at once (each attached to the session's Ray), so the module pays for about one
start, not two."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.families import hf_greedy, prompt, save
from tests.integration.conftest import PdserveServer, _start_server, _stop_all, session_ray_address

pytestmark = [pytest.mark.slow, pytest.mark.ray]
NEW_TOKENS = 8
SERVED = ("gemma3", "deepseek_v3")


@pytest.fixture(scope="module")
def served(ray_session: None, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, tuple[PdserveServer, Any]]]:
    models = {}
    for family in SERVED:
        folder = tmp_path_factory.mktemp(family)
        models[family] = (folder, save(family, folder))
    address = session_ray_address()

    def start(family: str) -> PdserveServer:
        # every prompt crosses the handoff (no short-prompt shortcut), in blocks of 4 tokens
        return _start_server(models[family][0], tmp_path_factory, "--disagg-min-tokens", "0",
                             "--block-size", "4", address=address)

    with ThreadPoolExecutor(len(SERVED)) as pool:
        servers = dict(zip(SERVED, pool.map(start, SERVED), strict=True))
    yield {family: (servers[family], models[family][1]) for family in SERVED}
    _stop_all(list(servers.values()))


def _words_to_ids(text: str) -> list[int]:
    return [int(word[1:]) for word in text.split()]


@pytest.mark.parametrize("family", SERVED)
def test_disaggregated_greedy_equals_transformers(served: dict[str, tuple[PdserveServer, Any]],
                                                  family: str) -> None:
    server, hf = served[family]
    prompts = [prompt(n, seed=n) for n in (6, 23, 41)]
    body = {"model": server_model(server), "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    got = [_words_to_ids(c["text"]) for c in choices]
    assert got == [hf_greedy(hf, ids, NEW_TOKENS) for ids in prompts]
    workers = httpx.get(f"{server.url}/v1/workers", timeout=30).json()["workers"]
    decode = next(w for w in workers if w["role"] == "decode")
    assert decode["transfer"]["blocks"] > 0 and decode["transfer"]["failures"] == 0  # the KV crossed over


def server_model(server: PdserveServer) -> str:
    return str(httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"])


def test_unsupported_architecture_lists_the_families(tmp_path: Path) -> None:
    """``--model`` on an architecture no family registers names every one that is supported."""
    from engine.loader import load_model_source

    (tmp_path / "config.json").write_text('{"architectures": ["Gemma4ForCausalLM"], "hidden_size": 8}')
    with pytest.raises(ValueError) as info:
        load_model_source(tmp_path)
    for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM"):
        assert name in str(info.value)
