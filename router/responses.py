"""Response bodies shaped exactly like OpenAI's (completion objects, stream chunks, usage, logprobs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from messages.wire import TokenLogprob
from router.streaming import ChoiceDecoder

Json = dict[str, object]
TokenText = Callable[[int], str]


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares."""

    id: str
    created: int
    model: str
    chat: bool
    service_tier: str | None = None  # echoed when the request named one

    def object_name(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def wrap(self, choices: list[Json], chunk: bool, usage: Json | None = None,
             with_usage: bool = False) -> Json:
        out: Json = {"id": self.id, "object": self.object_name(chunk), "created": self.created,
                     "model": self.model, "choices": choices}
        if self.chat:
            out["system_fingerprint"] = None
        if self.service_tier is not None:
            out["service_tier"] = self.service_tier
        if usage is not None or with_usage:
            out["usage"] = usage
        return out


def usage(decoders: Sequence[ChoiceDecoder], prompt_lens: Sequence[int], n: int) -> Json:
    """Prompt tokens count each prompt once; completion tokens sum over every choice."""
    prompt = sum(prompt_lens)
    completion = sum(d.num_tokens for d in decoders)
    cached = sum(decoders[i * n].cached_tokens for i in range(len(prompt_lens)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class LogprobFormatter:
    """Formats one choice's logprobs in the chat or the completions layout."""

    chat: bool
    token_text: TokenText
    offset: int = 0
    entries: list[Json] = field(default_factory=list)

    def _top(self, lp: TokenLogprob) -> list[tuple[str, float]]:
        return [(self.token_text(t), p) for t, p in lp.top]

    def format(self, lps: Sequence[TokenLogprob]) -> Json:
        if self.chat:
            content: list[Json] = []
            for lp in lps:
                tok = self.token_text(lp.token_id)
                top = [{"token": s, "logprob": p, "bytes": list(s.encode())} for s, p in self._top(lp)]
                content.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                                "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            tok = self.token_text(lp.token_id)
            tokens.append(tok)
            token_lps.append(lp.logprob)
            tops.append(dict(self._top(lp)))
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(parts: Sequence[Json], chat: bool) -> Json:
    """Concatenate formatted logprob pieces of one choice (for non-streaming responses)."""
    if chat:
        return {"content": [c for p in parts for c in p["content"]], "refusal": None}  # type: ignore[attr-defined]
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}  # type: ignore[attr-defined]


def choice(index: int, text: str | None, chat: bool, logprobs: Json | None, finish_reason: str | None,
           chunk: bool, tool_calls: list[Json] | None = None) -> Json:
    """One choice; for chat, ``tool_calls`` are the message's calls (whole) or the chunk's
    ``delta.tool_calls`` entries."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if chunk:
        delta: Json = {"content": text} if text else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    message: Json = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def role_chunk(index: int) -> Json:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}
