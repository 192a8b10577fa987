"""The chaos run's workload: seeded request shapes, one request sent and judged, outcomes by kind.

A :class:`Spec` is one request shape (chat or completion, prompt over a shared prefix, ``max_tokens``,
stop strings, greedy or sampled). Greedy specs get a reference text from an undisturbed run of the same
body (non-streaming, ``n=1``) before any fault; a greedy request under chaos must return exactly that
text in every choice, streamed or not. A sampled spec carries no stop string and ``ignore_eos``, so it
must return ``max_tokens`` tokens per choice and finish with ``length``.

Each sent request (:class:`Variant`) picks a spec, streaming or not, ``n`` (1 or 2) and, for the share
of client disconnects, when the client gives up: after a number of streamed chunks, or after a delay
for a non-streaming one. Every request ends as one :class:`Outcome` whose ``kind`` is

- ``ok``: completed and checked (greedy text equal to the reference, or a sampled one well formed);
- ``cancelled``: the client disconnected on purpose before the end;
- ``fault_error``: a clean, documented error (``ALLOWED_ERRORS``: the status, the OpenAI error body
  and its ``code``, and ``Retry-After`` on a 503), before the first byte or as the stream's error event;
- ``violation``: anything else (wrong text, an undocumented status or code, a broken stream, a
  transport error): each one fails the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("river", "stone", "garden", "window", "market", "letter", "silver", "harbor", "engine", "winter",
         "forest", "candle", "bridge", "pocket", "ladder", "mirror", "planet", "castle", "meadow", "signal",
         "copper", "island", "anchor", "feather", "lantern", "orchard", "valley", "compass", "blanket",
         "thunder", "station", "library", "kitchen", "harvest", "canyon", "shadow", "marble", "village",
         "journey", "captain")
QUESTIONS = ("Summarize the notes above in one sentence.", "List three objects mentioned above.",
             "Write a short poem about the notes.", "What would a child ask about these notes?",
             "Explain the notes to a tourist.", "Continue the list with five more words.")
STOPS = (["."], ["\n"], [" and", "!"])

# status -> documented error codes a fault may produce, and why (every one is counted and reported)
ALLOWED_ERRORS: dict[int, dict[str, str]] = {
    503: {
        "unavailable": "the decode worker died after the request had used its migrations, or no decode "
                       "worker was live (both restarting)",
        "prefill_died": "the prefill worker died and the policy left nothing to retry on",
        "prefill": "the prefill failed or timed out (its worker was being killed)",
        "transfer": "every KV pull failed (injected failures and killed prefill workers together)",
        "no_kv": "no KV room on the decode worker (the burst)",
        "overloaded": "the admission queue was full (the burst)",
    },
    408: {"request_timeout": "the request passed --request-timeout"},
    504: {"backend_timeout": "a worker-side deadline passed"},
}


@dataclass(frozen=True)
class Spec:
    key: int
    chat: bool
    system: str
    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    greedy: bool = True

    def body(self, stream: bool, n: int) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "n": n, "stream": stream, "ignore_eos": True,
                                "temperature": 0.0 if self.greedy else 0.8}
        if not self.greedy:
            body["seed"] = self.key
        if self.stop:
            body["stop"] = list(self.stop)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "system", "content": self.system},
                                {"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = f"{self.system}\n\n{self.prompt}\n"
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def make_specs(seed: int, count: int = 24, num_prefixes: int = 3, prefix_words: int = 60) -> list[Spec]:
    """``count`` seeded specs over ``num_prefixes`` shared prefixes; one in six is sampled."""
    rng = random.Random(seed)
    prefixes = ["Notes: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) + "."
                for _ in range(num_prefixes)]
    specs = []
    for key in range(count):
        greedy = key % 6 != 5
        stop = tuple(rng.choice(STOPS)) if greedy and key % 3 == 1 else ()
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        question = f"{rng.choice(QUESTIONS)} {words}"
        specs.append(Spec(key, chat=key % 2 == 0, system=prefixes[key % num_prefixes], prompt=question,
                          max_tokens=rng.randint(12, 40), stop=stop, greedy=greedy))
    return specs


@dataclass(frozen=True)
class Variant:
    """How one request of a spec is sent: streamed or not, ``n``, and when the client gives up (the
    number of streamed chunks, or seconds for a non-streaming request), if it does."""

    spec: Spec
    stream: bool
    n: int
    cancel_chunks: int | None = None
    cancel_seconds: float | None = None


def pick_variant(rng: random.Random, specs: list[Spec], disconnect_share: float) -> Variant:
    spec = rng.choice(specs)
    stream = rng.random() < 0.6
    n = 2 if rng.random() < 0.2 else 1
    chunks = seconds = None
    if rng.random() < disconnect_share:
        if stream:
            chunks = rng.randint(1, 6)
        else:
            seconds = rng.uniform(0.05, 1.5)
    return Variant(spec, stream, n, chunks, seconds)


@dataclass
class Outcome:
    spec: int
    stream: bool
    n: int
    phase: str
    start: float  # seconds since the run began
    kind: str = "ok"
    status: int = 0
    code: str = ""
    detail: str = ""
    ttft: float | None = None  # streaming: first text chunk; else the whole answer
    e2e: float | None = None
    greedy_checked: bool = False
    texts: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "texts"}


def _text_of(choice: dict[str, Any], chat: bool, stream: bool) -> str:
    if chat:
        part = choice.get("delta" if stream else "message") or {}
        return str(part.get("content") or "")
    return str(choice.get("text") or "")


def _error(outcome: Outcome, status: int, body: Any, headers: httpx.Headers | None) -> None:
    """Classify an error answer (HTTP status with an OpenAI error body, or a stream's error event)."""
    outcome.status = status
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        outcome.kind = "violation"
        outcome.detail = f"{status} without an OpenAI error body: {str(body)[:200]}"
        return
    outcome.code, outcome.detail = str(err.get("code")), err["message"][:300]
    # a stream's error event (200 already sent) stands for the status its code belongs to
    allowed = ALLOWED_ERRORS.get(status, {}) if status != 200 else \
        {code: why for codes in ALLOWED_ERRORS.values() for code, why in codes.items()}
    if outcome.code not in allowed:
        outcome.kind = "violation"
    elif status == 503 and headers is not None and "retry-after" not in headers:
        outcome.kind, outcome.detail = "violation", "503 without Retry-After: " + outcome.detail
    else:
        outcome.kind = "fault_error"


def judge(outcome: Outcome, spec: Spec, texts: list[str], finish: list[str | None], usage: dict[str, Any],
          reference: dict[int, str]) -> None:
    """A completed answer: greedy texts equal to the reference, or a sampled one of the right length."""
    outcome.texts = texts
    if spec.greedy:
        ref = reference.get(spec.key)
        if ref is None:
            return  # the reference pass itself
        outcome.greedy_checked = True
        bad = [i for i, t in enumerate(texts) if t != ref]
        if bad:
            outcome.kind = "violation"
            outcome.detail = f"choice {bad[0]} text {texts[bad[0]]!r} != reference {ref!r}"
        return
    want = spec.max_tokens * len(texts)
    if usage.get("completion_tokens") != want or any(f != "length" for f in finish):
        outcome.kind = "violation"
        outcome.detail = f"sampled answer: usage {usage}, finish {finish}, expected {want} tokens"


async def send(client: httpx.AsyncClient, url: str, model: str, v: Variant, phase: str, t0: float,
               reference: dict[int, str]) -> Outcome:
    """Send one request as ``v`` says and judge it (never raises but for cancellation)."""
    spec = v.spec
    start = time.perf_counter()
    out = Outcome(spec.key, v.stream, v.n, phase, start - t0)
    body = {"model": model, **spec.body(v.stream, v.n)}
    try:
        if v.stream:
            await _streamed(client, url, spec, v, body, out, start, reference)
        else:
            call = client.post(f"{url}{spec.path}", json=body)
            try:
                resp = await (asyncio.wait_for(call, v.cancel_seconds) if v.cancel_seconds else call)
            except TimeoutError:
                out.kind, out.detail = "cancelled", f"client gave up after {v.cancel_seconds:.2f} s"
                return out
            out.e2e = out.ttft = time.perf_counter() - start
            data = resp.json()
            if resp.status_code != 200:
                _error(out, resp.status_code, data, resp.headers)
                return out
            out.status = 200
            choices = sorted(data["choices"], key=lambda c: c["index"])
            judge(out, spec, [_text_of(c, spec.chat, False) for c in choices],
                  [c.get("finish_reason") for c in choices], data.get("usage") or {}, reference)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        out.kind, out.detail = "violation", f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


async def _streamed(client: httpx.AsyncClient, url: str, spec: Spec, v: Variant, body: dict[str, Any],
                    out: Outcome, start: float, reference: dict[int, str]) -> None:
    texts = [""] * v.n
    finish: list[str | None] = [None] * v.n
    usage: dict[str, Any] = {}
    chunks = 0
    async with client.stream("POST", f"{url}{spec.path}", json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            _error(out, resp.status_code, json.loads(raw) if raw else None, resp.headers)
            return
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                _error(out, 200, event, None)  # the stream's error event: 200 already sent
                return
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                piece = _text_of(c, spec.chat, True)
                if piece:
                    chunks += 1
                    if out.ttft is None:
                        out.ttft = time.perf_counter() - start
                texts[c["index"]] += piece
                finish[c["index"]] = c.get("finish_reason") or finish[c["index"]]
            if v.cancel_chunks is not None and chunks >= v.cancel_chunks:
                out.kind, out.detail = "cancelled", f"client disconnected after {chunks} chunks"
                return
        if not done:
            out.kind, out.detail = "violation", "the stream ended without [DONE]"
            return
    out.e2e = time.perf_counter() - start
    judge(out, spec, texts, finish, usage, reference)
