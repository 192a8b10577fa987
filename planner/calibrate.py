"""Serving costs outside the engine, measured on a running server with one and a few requests at a time.

``pdserve profile --calibrate URL`` sends ``n`` streaming completions one after another (short prompts,
each starting with a different word so no prefix-cache hit helps, ``max_tokens`` tokens each) and
compares what the client saw with what the profile's engine costs predict for an idle cluster:

- request overhead = median over requests of (TTFT - prefill of its prompt - the KV transfer): HTTP,
  tokenization, the router, the Ray calls and the token's way back;
- decode step overhead = median gap between two tokens - the decode step of one request: the worker's
  event loop and the stream back, per step; then ``BATCH_STREAMS`` requests decode together, and the
  overhead at that batch less the one at one request, over the extra requests, is the part each
  request in a step adds (its stream object, the router's work). They are added to
  ``DecodeCost.base_s`` and ``per_seq_s``.

All are clipped at zero. Then, for workers sharing one host's CPU, the interference: while one
request streams, a long prompt is sent; the median gap between its tokens during that prompt's
prefill over the median gap before it is how much a decode step stretches with two workers busy, and
``host_cores`` = 2 / that stretch (``planner/profile.py``; none when it is under 1.05). The loads are
one to four short requests at a time, never the load the simulator is later checked against.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time

import httpx

from planner.profile import Profile

BUSY_IN_PROBE = 2  # workers busy while the interference probe runs: one prefill, one decode
INTERFERENCE_TOKENS = 64
BATCH_STREAMS = 4  # requests decoding together in the second probe

WORDS = ("apple", "river", "stone", "cloud", "paper", "glass", "music", "tiger", "light", "sugar", "ocean",
         "maple", "bread", "silver", "forest", "candle")


def _one(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int,
         stamps: list[float] | None = None) -> tuple[float, list[float], int]:
    """(TTFT, gaps between text chunks, prompt tokens) of one streamed completion; ``stamps`` collects
    the ``time.perf_counter()`` of every text chunk as it arrives."""
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
                if stamps is not None:
                    stamps.append(now)
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
        batch = _concurrent(client, url, model, BATCH_STREAMS, 3 * max_tokens)
        stretch = _interference(client, url, model, timeout)
    calibrated = apply_calibration(profile, samples, max_tokens, f"{url} ({requests} requests one at a time, "
                                   f"then {BATCH_STREAMS} at once)", batch)
    return apply_interference(calibrated, stretch)


def apply_interference(profile: Profile, stretch: float) -> Profile:
    """``profile`` with ``host_cores`` from the interference probe's ``stretch`` (none under 1.05: no
    sharing is modelled then)."""
    host_cores = BUSY_IN_PROBE / stretch if stretch > 1.05 else None
    cores = f"{host_cores:.2f} effective cores" if host_cores is not None else "no host sharing modelled"
    return dataclasses.replace(profile, host_cores=host_cores,
                               notes=profile.notes + f"; a decode step took {stretch:.2f}x as long while "
                               f"the prefill worker computed a long prompt: {cores}")


def _concurrent(client: httpx.Client, url: str, model: str, streams: int,
                max_tokens: int) -> tuple[int, list[float], int]:
    """(streams, their pooled token gaps, prompt tokens of one) with ``streams`` short requests at once."""
    results: list[tuple[float, list[float], int]] = []

    def one(i: int) -> None:
        prompt = f"{WORDS[(i + 5) % len(WORDS)]} {i} " + "the quick brown fox jumps over the lazy dog " * 3
        results.append(_one(client, url, model, prompt, max_tokens))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) < streams:
        raise RuntimeError(f"--calibrate: {streams - len(results)} of {streams} concurrent requests failed")
    return streams, [g for _, gaps, _ in results for g in gaps], results[0][2]


def _interference(client: httpx.Client, url: str, model: str, timeout: float) -> float:
    """How much longer a decode step takes while a prefill worker computes: one request streams
    (``INTERFERENCE_TOKENS`` tokens) while a long prompt is sent; the median gap between its tokens
    during that prompt's prefill over the median gap before it."""
    stamps: list[float] = []
    prompt = "zebra 0 " + "the quick brown fox jumps over the lazy dog " * 3
    stream = threading.Thread(target=_one, args=(client, url, model, prompt, INTERFERENCE_TOKENS, stamps),
                              daemon=True)
    stream.start()
    deadline = time.perf_counter() + timeout
    while len(stamps) < 8 and stream.is_alive() and time.perf_counter() < deadline:
        time.sleep(0.01)
    b_start = time.perf_counter()
    ttft_b, _, _ = _one(client, url, model, "yak 1 " + "the quick brown fox jumps over the lazy dog " * 60, 1)
    b_end = b_start + ttft_b
    stream.join(timeout)
    pairs = list(zip(stamps, stamps[1:], strict=False))
    before = [b - a for a, b in pairs if b < b_start]
    during = [b - a for a, b in pairs if a >= b_start + 0.1 * ttft_b and b <= b_end]
    if len(before) < 3 or len(during) < 3:
        raise RuntimeError(f"--calibrate: too few tokens to compare ({len(before)} before the long prompt, "
                           f"{len(during)} during it)")
    return statistics.median(during) / statistics.median(before)


def apply_calibration(profile: Profile, samples: list[tuple[float, list[float], int]], max_tokens: int,
                      where: str, batch: tuple[int, list[float], int] | None = None) -> Profile:
    """``profile`` with the overheads of ``samples`` = (TTFT, gaps, prompt tokens) per request, one at
    a time, and ``batch`` = (streams, their pooled gaps, prompt tokens) of requests decoding together:
    the step overhead at one request and at ``streams`` give a fixed and a per-request part."""
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
    one = statistics.median(gaps_all) - step if gaps_all else 0.0
    per_seq = 0.0
    if batch is not None and batch[1] and batch[0] > 1:
        streams, gaps, n = batch
        many = statistics.median(gaps) - profile.decode.step_s(streams, streams * (n + max_tokens))
        per_seq = max(0.0, (many - one) / (streams - 1))
    step_overhead = max(0.0, one - per_seq)
    overhead = max(0.0, statistics.median(overheads))
    decode = dataclasses.replace(profile.decode, base_s=profile.decode.base_s + step_overhead,
                                 per_seq_s=profile.decode.per_seq_s + per_seq)
    note = (f"; calibrated on {where}: request overhead {overhead * 1000:.1f} ms, "
            f"decode step +{step_overhead * 1000:.1f} ms +{per_seq * 1000:.1f} ms per request")
    return dataclasses.replace(profile, request_overhead_s=overhead, decode=decode,
                               notes=profile.notes + note)
