"""Benchmark workloads: seeded session streams, prompt lengths counted with the model's tokenizer.

A workload yields :class:`Session` objects forever (the runner stops taking them
when its time is up). A session is one request (``random``, ``shared-prefix``,
``long-context``, ``mixed``, ``copy-heavy``) or several chat turns sent one after the other, each
resending the whole history with the server's earlier answers (``multi-turn``). ``copy-heavy``
asks for answers that repeat what the prompt supplies (a document quoted back, code returned with
one identifier renamed), where speculative decoding's n-gram lookup pays.

Prompt text is built from "word tokens": vocabulary entries that decode to a
space and 3-10 lowercase letters and encode back to themselves, so ``n`` of them
joined encode to ``n`` tokens (the tokenizer splits on spaces first). Token counts
stated here are those of the user/system text, before any chat template adds its
own tokens. The same ``seed`` and parameters give the same sessions. The workloads' names,
parameters and defaults are ``planner/workload_params.py``'s, shared with the simulator.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from planner.workload_params import WORKLOADS as WORKLOADS
from planner.workload_params import parse_params as parse_params
from planner.workload_params import workload_params

WORD_RE = re.compile(r"^ [a-z]{3,10}$")


class TextTokenizer(Protocol):
    """The part of ``engine.tokenizer.Tokenizer`` the workloads use."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Turn:
    """One request's new text: a user message (chat) or the whole prompt (completion)."""

    text: str
    max_tokens: int
    text_tokens: int


@dataclass(frozen=True)
class Session:
    """Requests sent one after another; chat turns carry the history (and the answers) before them."""

    kind: Literal["completion", "chat"]
    turns: tuple[Turn, ...]
    system: str | None = None
    system_tokens: int = 0
    label: str = ""

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """Chat messages for ``turn``: system, then earlier user turns with ``answers``, then this turn."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            msgs.append({"role": "user", "content": self.turns[i].text})
            msgs.append({"role": "assistant", "content": answers[i] if i < len(answers) else ""})
        msgs.append({"role": "user", "content": self.turns[turn].text})
        return msgs


class WordSource:
    """Seeded text of an exact token count, from the tokenizer's single-token words."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        ids = list(range(tokenizer.vocab_size))
        hf = getattr(tokenizer, "hf", None)
        if hf is not None:  # a Hugging Face tokenizer: batch calls (much faster than one by one)
            texts = hf.batch_decode([[i] for i in ids], skip_special_tokens=True)
            cand = [(i, t) for i, t in zip(ids, texts, strict=True) if WORD_RE.match(t)]
            encoded = hf([t for _, t in cand], add_special_tokens=False)["input_ids"] if cand else []
            words = [t for (i, t), enc in zip(cand, encoded, strict=True) if enc == [i]]
        else:
            words = [t for i in ids if WORD_RE.match(t := tokenizer.decode([i], skip_special_tokens=True))
                     and tokenizer.encode(t) == [i]]
        if len(words) < 100:
            raise ValueError(f"the tokenizer has only {len(words)} plain word tokens; need at least 100")
        self.words = words
        # words that are one token without their leading space too, to start a text with
        stripped = [w.lstrip() for w in words]
        lengths = ([len(e) for e in hf(stripped, add_special_tokens=False)["input_ids"]] if hf is not None and
                   stripped else [len(tokenizer.encode(w)) for w in stripped])
        self.first_words = [w for w, n in zip(stripped, lengths, strict=True) if n == 1]

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """``num_tokens`` words (``num_tokens`` tokens), starting without a leading space."""
        if num_tokens <= 0:
            return ""
        return rng.choice(self.first_words) + "".join(rng.choice(self.words) for _ in range(num_tokens - 1))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


@dataclass
class Workload:
    """A named, seeded session stream with its parameters (``params`` override ``defaults``)."""

    name: str
    params: dict[str, float]
    make: Callable[[WordSource, random.Random, dict[str, float]], Iterator[Session]] = field(repr=False)

    def sessions(self, words: WordSource, seed: int = 0) -> Iterator[Session]:
        return self.make(words, random.Random(seed), self.params)


def _int(p: dict[str, float], key: str) -> int:
    return int(p[key])


def _random(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    n_in, n_out = _int(p, "input_len"), _int(p, "output_len")
    while True:
        yield Session("completion", (Turn(words.text(rng, n_in), n_out, n_in),), label="random")


def _shared_prefix(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    n_sys, n_q = _int(p, "num_prefixes"), _int(p, "questions_per_prefix")
    prefix_len, q_len, n_out = _int(p, "prefix_len"), _int(p, "question_len"), _int(p, "output_len")
    share = float(p["share"])
    systems = [words.text(rng, prefix_len) for _ in range(n_sys)]
    while True:
        order = [(s, q) for s in range(n_sys) for q in range(n_q)]
        rng.shuffle(order)
        for s, _ in order:
            question = words.text(rng, q_len)
            if rng.random() < share:
                yield Session("chat", (Turn(question, n_out, q_len),), systems[s], prefix_len, f"prefix{s}")
            else:
                yield Session("chat", (Turn(question, n_out, q_len),), words.text(rng, prefix_len),
                              prefix_len, "unique")


def _multi_turn(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    n_turns, u_len, n_out = _int(p, "turns"), _int(p, "user_len"), _int(p, "output_len")
    while True:
        turns = tuple(Turn(words.text(rng, u_len), n_out, u_len) for _ in range(n_turns))
        yield Session("chat", turns, label="multi-turn")


def _long_context(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    n_out = _int(p, "output_len")
    doc_len = _int(p, "context_len") - n_out - _int(p, "margin")
    if doc_len < 16:
        raise ValueError(f"long-context: context_len leaves {doc_len} document tokens; raise context_len")
    while True:
        body = words.text(rng, doc_len - 4)
        text = "summarize this document " + body
        yield Session("completion", (Turn(text, n_out, words.count(text)),), label="long-context")


def _mixed(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    rag_share = float(p["rag_share"])
    lo, hi = _int(p, "short_min"), _int(p, "short_max")
    rag_lo, rag_hi = _int(p, "rag_min"), _int(p, "rag_max")
    out_lo, out_hi = _int(p, "output_min"), _int(p, "output_max")
    instructions = words.text(random.Random(1), _int(p, "rag_system_len"))
    while True:
        n_out = rng.randint(out_lo, out_hi)
        if rng.random() < rag_share:
            n_ctx = rng.randint(rag_lo, rag_hi)
            passages = words.text(rng, n_ctx)
            question = words.text(rng, rng.randint(lo, hi))
            text = f"{passages}\n\n{question}"
            yield Session("chat", (Turn(text, n_out, words.count(text)),), instructions,
                          words.count(instructions), "rag")
        else:
            n = rng.randint(lo, hi)
            yield Session("chat", (Turn(words.text(rng, n), n_out, n),), label="chat")


SENTENCES = (
    "The committee approved the new budget after a long discussion about maintenance costs.",
    "Our office will be closed on Monday, and support tickets will be answered on Tuesday morning.",
    "The bridge was built in 1932 and repaired twice after the floods of the following decades.",
    "Customers who ordered before the fifth of March will receive their parcels within two weeks.",
    "The library lends laptops to students for up to seven days, with one renewal allowed.",
    "A light rain is expected in the afternoon, clearing up by evening with a cool northern wind.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and a spoon of honey.",
    "Each team member should update the shared spreadsheet before the Friday review meeting.",
    "The museum's new wing displays maps, compasses and letters from early coastal expeditions.",
    "Passengers must show a valid ticket and an identity card before boarding the night train.",
    "The software update fixes a crash on startup and improves the speed of large file uploads.",
    "Volunteers planted three hundred trees along the river to protect the banks from erosion.",
    "The contract may be cancelled by either party with thirty days of written notice.",
    "Our quarterly report shows steady growth in the northern region and flat sales elsewhere.",
    "The patient should take one tablet twice a day with food and avoid driving at night.",
    "The old harbour now hosts a fish market every Saturday and a music festival in August.",
    "Applicants need a cover letter, two references and a copy of their latest diploma.",
    "The city council plans to add bicycle lanes to the main avenue by the end of next year.",
    "The printer on the second floor is out of toner, so please use the one near the kitchen.",
    "Mountain guides recommend starting the climb before sunrise to avoid afternoon storms.",
    "The warranty covers parts and labour for two years but not damage caused by water.",
    "Each chapter ends with a short summary and a list of questions for class discussion.",
    "The school choir will perform at the town hall on the last evening before the holidays.",
    "Engineers replaced the cooling pumps, and the plant returned to full power on Thursday.",
)
FUNCTION = """def {name}({a}, {b}):
    \"\"\"Return the {c} of {a} and {b}.\"\"\"
    {c} = []
    for {item} in {a}:
        if {item} in {b}:
            {c}.append({item})
        elif len({c}) > {n}:
            break
    return {c}
"""


def _copy_heavy(words: WordSource, rng: random.Random, p: dict[str, float]) -> Iterator[Session]:
    """Answers that copy most of what the prompt supplies: quote a document back, or return a whole
    piece of code with one identifier renamed."""
    n_sentences, n_functions, n_out = _int(p, "sentences"), _int(p, "functions"), _int(p, "output_len")
    code_share = float(p["code_share"])
    names = [w.strip() for w in words.words]
    while True:
        if rng.random() < code_share:
            parts = []
            for _ in range(n_functions):
                a, b, c, item, name = rng.sample(names, 5)
                parts.append(FUNCTION.format(name=f"find_{name}", a=a, b=b, c=c, item=item,
                                             n=rng.randint(2, 9)))
            code = "\n".join(parts)
            old = rng.choice(parts).split("(")[1].split(",")[0]
            text = (f"Rename the variable `{old}` to `{rng.choice(names)}_list` in this code and return the "
                    f"whole code:\n\n```python\n{code}```")
            label = "code-edit"
        else:
            doc = " ".join(rng.sample(SENTENCES, min(n_sentences, len(SENTENCES))))
            text = f"Copy the following text exactly, word for word:\n\n{doc}"
            label = "quote"
        yield Session("chat", (Turn(text, n_out, words.count(text)),), label=label)


MAKERS: dict[str, Callable[[WordSource, random.Random, dict[str, float]], Iterator[Session]]] = {
    "random": _random, "shared-prefix": _shared_prefix, "multi-turn": _multi_turn,
    "long-context": _long_context, "mixed": _mixed, "copy-heavy": _copy_heavy,
}


def make_workload(name: str, params: dict[str, float] | None = None) -> Workload:
    """The workload ``name`` with ``params`` over its defaults; ValueError for an unknown name or key."""
    return Workload(name, workload_params(name, params), MAKERS[name])


def describe(workload: Workload) -> dict[str, Any]:
    return {"name": workload.name, **workload.params}
