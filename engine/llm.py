"""``LLM``: the offline Python API, vLLM-like.

``LLM(model=..., tensor_parallel_size=N)`` runs rank 0 in this process and starts ranks 1..N-1 as
processes of its own (``engine/tp_ranks.py``, no Ray); ``close()`` stops them, and so do garbage
collection and interpreter exit (``weakref.finalize``), and a failed start.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any, cast

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_model_source, resolve_model
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.tensor_parallel import check_tp_size
from engine.tokenizer import Tokenizer
from engine.tp_ranks import RankProcesses

Prompt = str | list[int]


def start_engine(model: str | None, config: EngineConfig, check_integrity: bool = False,
                 extension: str = "") -> tuple[LLMEngine, RankProcesses | None]:
    """An engine, with its rank processes when ``config.tensor_parallel_size`` > 1 (``extension``: see
    ``engine/tp_ranks.py``); the caller closes the ranks. A failed start stops the ranks it started."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(model, config, check_integrity=check_integrity), None
    path = resolve_model(model)
    check_tp_size(load_model_source(path).config, config.tensor_parallel_size)
    ranks = RankProcesses(path, config, extension=extension)
    try:
        return LLMEngine(str(path), config, check_integrity=check_integrity, group=ranks.group), ranks
    except BaseException:
        ranks.close()
        raise
Message = dict[str, str]


class LLM:
    """``LLM(model=None, dtype="float32", **engine_args)``; ``engine_args`` are EngineConfig fields."""

    def __init__(self, model: str | None = None, check_integrity: bool = False, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine, self.ranks = start_engine(model, EngineConfig(**engine_args), check_integrity)
        if self.ranks is not None:
            self._finalizer = weakref.finalize(self, self.ranks.close)

    def close(self) -> None:
        """Stop the tensor-parallel rank processes (nothing to do without them); idempotent."""
        if self.ranks is not None:
            self._finalizer()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        batch = _as_batch(prompts)
        if params is None or isinstance(params, SamplingParams):
            per = [params or SamplingParams()] * len(batch)
        else:
            per = list(params)
            if len(per) != len(batch):
                raise ValueError(f"{len(per)} sampling params for {len(batch)} prompts")
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(batch, per, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if use_tqdm:
                        print(f"\rfinished {len(done)}/{len(ids)}", end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = cast(list[list[Message]], [messages] if _is_conversation(messages) else messages)
        prompts: list[Prompt] = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]
    return cast(list[Prompt], items)


def _is_conversation(messages: list[Message] | list[list[Message]]) -> bool:
    return bool(messages) and isinstance(messages[0], dict)
