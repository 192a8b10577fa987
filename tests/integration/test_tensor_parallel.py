"""Tensor parallelism end to end: ``LLM(tensor_parallel_size=N)`` starts real rank processes (gloo over
loopback); greedy tokens equal TP=1 and transformers token for token (float32, CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cli.plan import make_plan, read_model_config
from engine import LLM, SamplingParams
from engine.tp_group import TpError
from tests.conftest import load_transformers_reference
from tests.unit.conftest import save_word_tokenizer

pytestmark = pytest.mark.slow

VOCAB = 255  # not a multiple of 2 or 3: the last vocabulary shard is padded
NEW_TOKENS = 8
KV_MEMORY = 1024**2
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
    max_position_embeddings=512, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    pad_token_id=None,
)
VARIANTS: dict[str, Any] = {  # 8 query heads of 8 dims each
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **COMMON)),
    "mqa": lambda: LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **COMMON)),  # 1 KV head, replicated
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **COMMON)),  # qkv bias
    "tied": lambda: LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=True, **COMMON)),
}
ENGINE: dict[str, Any] = dict(dtype="float32", max_num_batched_tokens=32, num_threads=1,
                              kv_cache_memory=KV_MEMORY, tp_timeout_s=20.0)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # 41 tokens: three blocks, prefilled in two chunks
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 23, 41)]


def save(variant: str, folder: Path) -> Any:
    torch.manual_seed(0)
    model = VARIANTS[variant]().eval()
    with torch.no_grad():  # transformers inits norms to 1 and biases to 0: perturb them
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    save_word_tokenizer(folder, VOCAB)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
    return list(out[0, len(ids):].tolist())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tp2_equals_tp1_and_transformers(variant: str, tmp_path: Path) -> None:
    hf = save(variant, tmp_path)
    batch = prompts()
    reference = [hf_greedy(hf, ids) for ids in batch]
    one = LLM(model=str(tmp_path), **ENGINE)
    assert [o.token_ids for o in one.generate(batch, greedy())] == reference
    two = LLM(model=str(tmp_path), tensor_parallel_size=2, check_integrity=True, **ENGINE)
    try:
        assert [o.token_ids for o in two.generate(batch, greedy())] == reference
        runner = two.engine.runner
        kv_heads = max(hf.config.num_key_value_heads // 2, 1)
        assert runner.kv_cache.shape[4] == kv_heads  # rank 0's KV shard: its heads only
        assert two.engine.kv.pool.num_used_blocks == 0
        assert runner.group is not None and runner.group.steps > 0
        # `pdserve plan` at TP=2 is the engine's own allocation: weights and blocks per device
        plan = make_plan(read_model_config(tmp_path), dtype="float32", kv_cache_memory=KV_MEMORY,
                         tensor_parallel_size=2)
        assert plan.kv_heads_per_device == kv_heads
        assert plan.num_kv_blocks == two.engine.kv.num_blocks == runner.kv_cache.shape[1]
        assert plan.weight_bytes == sum(p.numel() * p.element_size() for p in runner.model.parameters())
    finally:
        two.close()
    assert two.ranks is not None and two.ranks.alive() == [False]


def test_smollm2_at_tp3_equals_transformers(default_model_path: Path) -> None:
    """SmolLM2-135M (9 query / 3 KV heads, the default GGUF) over 3 ranks: one KV head each. Both prompts
    are among tests/integration/test_engine_vs_hf.py's, where TP=1 equals transformers on them; here
    TP=3 equals transformers, whose model of the GGUF is the stored one ``transformers_default_model``
    also reads (that fixture itself would need this module in ``SHARED_SCOPES``, tests/conftest.py)."""
    args: dict[str, Any] = dict(dtype="float32", num_threads=1, kv_cache_memory=16 * 1024**2)
    three = LLM(model=str(default_model_path), tensor_parallel_size=3, **args)
    try:
        tok = three.tokenizer
        batch = [tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
                 tok.encode("The three primary colors are")]
        got = [o.token_ids for o in three.generate(batch, greedy())]
        assert three.engine.runner.kv_cache.shape[4] == 1
    finally:
        three.close()
    reference = load_transformers_reference(default_model_path)
    assert got == [hf_greedy(reference, ids) for ids in batch]
    assert "Paris" in tok.decode(got[0])


def test_a_killed_rank_is_an_error_within_the_deadline_not_a_hang(tmp_path: Path) -> None:
    save("llama", tmp_path)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert llm.ranks is not None
    try:
        [first] = llm.generate([prompts()[0]], greedy())
        assert len(first.token_ids) == NEW_TOKENS
        llm.ranks.processes[0].kill()
        llm.ranks.processes[0].join(timeout=10)
        start = time.monotonic()
        with pytest.raises(TpError, match="rank 0 of 2"):
            llm.generate([prompts()[1]], greedy())
        assert time.monotonic() - start < ENGINE["tp_timeout_s"] + 5
    finally:
        llm.close()


def test_a_hung_rank_is_an_error_after_the_deadline(tmp_path: Path) -> None:
    save("llama", tmp_path)
    llm = LLM(model=str(tmp_path), tensor_parallel_size=2, **{**ENGINE, "tp_timeout_s": 3.0})
    assert llm.ranks is not None
    llm.ranks.grace_s = 0.5
    rank1 = llm.ranks.processes[0]
    try:
        assert rank1.pid is not None
        os.kill(rank1.pid, signal.SIGSTOP)  # alive, holding its sockets open, answering nothing
        start = time.monotonic()
        with pytest.raises(TpError, match="rank 0 of 2"):
            llm.generate([prompts()[1]], greedy())
        assert 2.5 < time.monotonic() - start < 10
    finally:
        llm.close()  # a stopped process ignores terminate(): close() kills it
    assert not rank1.is_alive()


def test_rank_processes_end_with_the_interpreter(tmp_path: Path) -> None:
    save("llama", tmp_path)
    script = ("import sys; from engine import LLM; "
              f"llm = LLM(model={str(tmp_path)!r}, tensor_parallel_size=2, dtype='float32', num_threads=1, "
              f"kv_cache_memory={KV_MEMORY}); print(llm.ranks.processes[0].pid, flush=True)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _exists(pid):
        time.sleep(0.1)
    assert not _exists(pid)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone, only not yet reaped
