"""Speculative decoding on SmolLM2: greedy tokens equal decoding without it, in process (copy prompts and
engine test prompts, and a request continued elsewhere as migration does) and over HTTP through a
disaggregated `pdserve serve --speculative-config ...` (1 prefill, 1 decode): completions, a stop
string, logprobs, the spec_decode metrics, and a storm of disconnects that leaves no KV held (n-gram);
SmolLM2 as its own draft model accepts every proposal, in process and over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from tests.integration.test_engine_vs_hf import CHATS, RAW
from tests.waiting import wait_until

if TYPE_CHECKING:
    from tests.integration.conftest import PdserveServer

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NEW_TOKENS = 48
QUOTE = ("Copy the following text exactly, word for word:\n\nThe committee approved the new budget after a "
         "long discussion about maintenance costs. Our office will be closed on Monday, and support "
         "tickets will be answered on Tuesday morning. The bridge was built in 1932 and repaired twice.")
CODE = ("Rename the variable `items` to `values` in this code and return the whole code:\n\n```python\n"
        "def total(items):\n    result = 0\n    for x in items:\n        result += x\n    return result\n```")
STORM = 8
# what a worker still holds: (part, figure) of its /v1/workers entry (messages.wire.WorkerStats)
BUSY_FIELDS = (("kv", "used_blocks"), ("requests", "running"), ("leases", "held"), ("requests", "reserved"))


@pytest.fixture(scope="module")
def plain(default_model_path: Path) -> LLM:
    return LLM(str(default_model_path), check_integrity=True)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    tok = plain.tokenizer
    out = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in [QUOTE, CODE, CHATS[0]]]
    return out + [tok.encode(RAW[0])]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(prompts, greedy())]


def test_engine_greedy_equal_and_continued_after_migration(
    default_model_path: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    llm = LLM(str(default_model_path), check_integrity=True, speculative_config=NGRAM)
    outs = llm.generate(prompts, greedy())
    for i, (out, ref) in enumerate(zip(outs, reference, strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged"
    spec = llm.engine.stats().spec
    assert spec is not None and spec.num_accepted_tokens > 0 and spec.mean_accepted_length > 1.5
    # migration: another engine continues from the prompt plus the tokens generated so far
    i, cut = 0, 20  # the quote
    [rest] = llm.generate([prompts[i] + reference[i][:cut]], greedy(NEW_TOKENS - cut))
    assert reference[i][:cut] + rest.token_ids == reference[i]
    assert llm.engine.kv.pool.num_used_blocks == 0


def draft_model(path: Path) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4}


def test_engine_smollm2_as_its_own_draft_accepts_every_proposal(
    default_model_path: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    spec = draft_model(default_model_path)
    llm = LLM(str(default_model_path), check_integrity=True, speculative_config=spec)
    outs = llm.generate(prompts[:2], greedy())
    assert [o.token_ids for o in outs] == reference[:2]
    stats = llm.engine.stats().spec
    assert stats is not None and stats.num_draft_tokens > 40
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.fixture(scope="module")
def server(pdserve_factory: Callable[..., PdserveServer]) -> PdserveServer:
    return pdserve_factory("--speculative-config", json.dumps(NGRAM), "--served-model-name", "m")


def metric(server: PdserveServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def wait_drained(server: PdserveServer, timeout: float = 60.0) -> None:
    seen: list[dict[str, Any]] = []

    def drained() -> bool:
        seen[:] = httpx.get(f"{server.url}/v1/workers", timeout=10).json()["workers"]
        return len(seen) == 2 and not any(w[a][b] for w in seen for a, b in BUSY_FIELDS)

    def busy() -> dict[str, dict[str, Any]]:
        return {w["worker_id"]: {f"{a}.{b}": w[a][b] for a, b in BUSY_FIELDS if w[a][b]} for w in seen}

    wait_until(drained, timeout, "two workers holding nothing", 0.2, busy)


def complete(server: PdserveServer, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, **extra}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_http_disaggregated_greedy_stop_logprobs_metrics_and_disconnects(
    server: PdserveServer, plain: LLM, reference: list[list[int]]
) -> None:
    tok = plain.tokenizer
    # the quote, the code edit and a raw completion prompt: prompts 0, 1 and 3 rendered as text
    texts = [tok.render_chat([{"role": "user", "content": c}]) for c in (QUOTE, CODE)] + [RAW[0]]
    refs = [reference[0], reference[1], reference[3]]
    for text, ref in zip(texts, refs, strict=True):
        body = complete(server, text)
        assert body["choices"][0]["text"] == tok.decode(ref)
        assert body["usage"]["completion_tokens"] == len(ref)
    drafts = metric(server, "pdserve:spec_decode_num_drafts_total", role="decode")
    accepted = metric(server, "pdserve:spec_decode_num_accepted_tokens_total", role="decode")
    assert drafts > 0 and accepted > 0
    assert metric(server, "pdserve:spec_decode_num_drafts_total", role="prefill") == 0
    assert metric(server, "pdserve:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0

    quote = tok.decode(refs[0])
    stop = quote[len(quote) // 2:len(quote) // 2 + 12]
    body = complete(server, texts[0], stop=[stop], logprobs=1)
    choice = body["choices"][0]
    assert choice["text"] == quote[:quote.index(stop)] and choice["finish_reason"] == "stop"
    body = complete(server, texts[1], logprobs=2)
    lps = body["choices"][0]["logprobs"]
    assert len(lps["tokens"]) == body["usage"]["completion_tokens"] == len(refs[1])
    assert all(len(top) == 2 for top in lps["top_logprobs"])

    async def one(http: httpx.AsyncClient) -> int:
        body = {"model": "m", "prompt": texts[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            got = 0
            async for line in resp.aiter_lines():
                got += line.startswith("data: {")
                if got == 3:
                    break
            return got

    async def storm() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            return list(await asyncio.wait_for(asyncio.gather(*[one(http) for _ in range(STORM)]), 180))

    assert asyncio.run(storm()) == [3] * STORM
    wait_drained(server)
    assert metric(server, "pdserve:kv_cache_usage_perc") == 0.0


def test_http_disaggregated_draft_model(pdserve_factory: Callable[..., PdserveServer],
                                        default_model_path: Path, plain: LLM,
                                        reference: list[list[int]]) -> None:
    """The draft runs on the decode worker only; every proposal of SmolLM2's own draft is accepted."""
    server = pdserve_factory("--speculative-config", json.dumps(draft_model(default_model_path)),
                             "--served-model-name", "m")
    try:
        text = plain.tokenizer.render_chat([{"role": "user", "content": QUOTE}])
        body = complete(server, text)
        assert body["choices"][0]["text"] == plain.tokenizer.decode(reference[0])
        proposed = metric(server, "pdserve:spec_decode_num_draft_tokens_total", role="decode")
        assert proposed >= 4 * (len(reference[0]) // 5)  # 4 proposed per 5 tokens, all accepted
        assert metric(server, "pdserve:spec_decode_num_accepted_tokens_total", role="decode") == proposed
        assert metric(server, "pdserve:spec_decode_num_drafts_total", role="prefill") == 0
    finally:
        server.stop()
