"""Fixed serving costs outside the engine, measured on a running server, one request at a time.

``pdserve profile --calibrate URL`` sends ``n`` streaming completions one after another (short prompts,
each starting with a different word so no prefix-cache hit helps, ``max_tokens`` tokens each) and
compares what the client saw with what the profile's engine costs predict for an idle cluster:

- request overhead = median over requests of (TTFT - prefill of its prompt - the KV transfer): HTTP,
  tokenization, the router, the Ray calls and the token's way back;
- decode step overhead = median gap between two tokens - the decode step of one request: the worker's
  event loop and the stream back, per step. It is added to ``DecodeCost.base_s``.

Both are clipped at zero. The load is one request at a time, never the load the simulator is later
checked against.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import httpx

from planner.profile import Profile

WORDS = ("apple", "river", "stone", "cloud", "paper", "glass", "music", "tiger", "light", "sugar", "ocean",
         "maple", "bread", "silver", "forest", "candle")


def _one(client: httpx.Client, url: str, model: str, prompt: str,
         max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, gaps between text chunks, prompt tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    last, prompt_tokens = start, 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"--calibrate: {url} answered {resp.status_code}: {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("usage"):
                prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
    if ttft is None:
        raise RuntimeError(f"--calibrate: {url} streamed no text")
    return ttft, gaps, prompt_tokens


def calibrate(profile: Profile, url: str, *, requests: int = 10, max_tokens: int = 16,
              api_key: str | None = None, timeout: float = 120.0) -> Profile:
    """``profile`` with ``request_overhead_s`` and the decode step base measured on ``url`` (see above)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = url.rstrip("/")
    samples: list[tuple[float, list[float], int]] = []
    with httpx.Client(timeout=timeout, headers=headers) as client:
        model = client.get(f"{url}/v1/models").raise_for_status().json()["data"][0]["id"]
        _one(client, url, model, "warm up " * 8, 2)
        for i in range(requests):
            prompt = f"{WORDS[i % len(WORDS)]} {i} " + "the quick brown fox jumps over the lazy dog " * 3
            samples.append(_one(client, url, model, prompt, max_tokens))
    return apply_calibration(profile, samples, max_tokens, f"{url} ({requests} requests one at a time)")


def apply_calibration(profile: Profile, samples: list[tuple[float, list[float], int]], max_tokens: int,
                      where: str) -> Profile:
    """``profile`` with the overheads of ``samples`` = (TTFT, gaps, prompt tokens) per request."""
    overheads: list[float] = []
    gaps_all: list[float] = []
    contexts: list[int] = []
    for ttft, gaps, n in samples:
        blocks = -(-n // profile.model.block_size)
        nbytes = blocks * profile.model.block_size * profile.model.kv_bytes_per_token
        overheads.append(ttft - profile.prefill.prompt_s(n) - profile.transfer.seconds(nbytes))
        gaps_all.extend(gaps)
        contexts.append(n + max_tokens // 2)
    step = profile.decode.step_s(1, int(statistics.median(contexts)))
    step_overhead = max(0.0, statistics.median(gaps_all) - step) if gaps_all else 0.0
    overhead = max(0.0, statistics.median(overheads))
    decode = dataclasses.replace(profile.decode, base_s=profile.decode.base_s + step_overhead)
    note = (f"; calibrated on {where}: request overhead {overhead * 1000:.1f} ms, "
            f"decode step +{step_overhead * 1000:.1f} ms")
    return dataclasses.replace(profile, request_overhead_s=overhead, decode=decode,
                               notes=profile.notes + note)
