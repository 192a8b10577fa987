"""What one disaggregated handoff moves, and what a sequence holds, for hybrid and latent-attention KV.

``python -m bench.lab.handoff_bytes`` builds random-weight models with transformers (saved once under
``$PDSERVE_CACHE/bench``; nothing from a hub), runs one prompt through an in-process prefill worker and
a decode worker (the real workers, the KV pulled over NIXL as in serving), and reads the bytes and
blocks the decode worker's pull placed (``WorkerStats.transfer``) and the blocks each holds:

- ``gemma3``: a Gemma-3-shaped model (five sliding-window layers to one global) at ``--prompt`` tokens
  with ``--window``, the hybrid KV manager on (only the blocks each KV group still reads cross) against
  off (every layer's every block); and the blocks a sequence of ``--context`` tokens holds, in layer
  blocks, against full attention;
- ``mla``: a DeepSeek-V3-shaped latent cache (one row of ``kv_lora_rank`` + ``qk_rope_head_dim``
  values per token per layer) against a GQA model of the same hidden size and layers (8 KV heads of
  128, Llama-3's), bytes per handoff and KV blocks per GiB.

The figures are counts, not timings: they depend on the shapes alone. ``handoff(model, config,
tokens)`` is the measurement; ``expected_*`` the arithmetic each count must equal
(``tests/unit/test_handoff_bytes.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.kv_groups import NULL_BLOCK, kv_groups
from engine.loader import cache_root, load_model_source
from engine.sampling_params import SamplingParams
from messages.codec import pack, unpack
from messages.wire import GenerateRequest, OutputFrame, PrefillResult, TokenBatch, WorkerError, WorkerStats

GIB = 1024**3
NO_SPECIAL_TOKENS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def gemma3_config(layers: int = 12, hidden: int = 512, window: int = 512,
                  vocab: int = 1024) -> dict[str, Any]:
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "layer_types": kinds,
            "sliding_window": window, "max_position_embeddings": 16384, "query_pre_attn_scalar": 64,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def mla_config(layers: int = 4, hidden: int = 1024, vocab: int = 1024) -> dict[str, Any]:
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": 256,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 384, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "max_position_embeddings": 16384, **NO_SPECIAL_TOKENS}


def gqa_config(layers: int = 4, hidden: int = 1024, vocab: int = 1024) -> dict[str, Any]:
    """A Llama of ``hidden`` with 8 KV heads of 128 (Llama-3's KV shape)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 16384, **NO_SPECIAL_TOKENS}


def model_dir(fields: dict[str, Any], root: Path | None = None) -> Path:
    """The model of ``fields`` (a ``config.json``), built by transformers with seeded random weights and
    a word-level tokenizer, saved on the first call."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    root = root or cache_root() / "bench"
    folder = root / f"{fields['model_type']}-{digest}"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".handoff-", dir=root))
    try:
        torch.manual_seed(0)
        config = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "architectures"})
        AutoModelForCausalLM.from_config(config).save_pretrained(str(staging), safe_serialization=True)
        words = ["[UNK]"] + [f"w{i}" for i in range(1, fields["vocab_size"])]
        raw = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        raw.pre_tokenizer = Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(staging))
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@dataclasses.dataclass(frozen=True)
class Handoff:
    bytes: int  # placed in the decode worker's cache by the pull
    blocks: int  # block pairs read (every KV group's)
    held_blocks: list[int]  # the decode worker's blocks of the request, per KV group, after the pull
    slots: int  # layers a block of the decode worker's cache holds
    block_bytes: int  # bytes of one block (all its slots)


def handoff(model: Path, config: EngineConfig, tokens: int) -> Handoff:
    """One prompt of ``tokens`` tokens prefilled on one worker and pulled by another, in one process."""
    from decode.worker import DecodeWorker
    from prefill.worker import PrefillWorker

    prefill = PrefillWorker("prefill-b", str(model), pack(config))
    decode = DecodeWorker("decode-b", str(model), pack(config))
    req = GenerateRequest(request_id="handoff", prompt_token_ids=[1 + i % 500 for i in range(tokens)],
                          sampling=SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))

    async def flow() -> Handoff:
        await decode.ready()
        await decode.connect(await prefill.ready())
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        answer.set_result(await prefill.prefill(pack(req)))
        assert isinstance(unpack(answer.result(), PrefillResult | WorkerError), PrefillResult)
        channel = uuid.uuid4().hex
        frames = decode.outputs(channel)
        submit = asyncio.create_task(decode.submit(channel, 1, pack(req), [answer]))
        held: list[int] = []
        async for data in frames:
            item = unpack(data, OutputFrame).items[0].item
            if not held:  # after the pull, at its first token: what it holds; then it is stopped
                tables = await decode.aengine.read(lambda e: e.kv.tables_of(req.request_id))
                held = [sum(b != NULL_BLOCK for b in t) for t in tables]
                await decode.abort(req.request_id)
            if isinstance(item, WorkerError):
                raise RuntimeError(item.message)
            assert isinstance(item, TokenBatch)
            if item.finished:
                break
        await frames.aclose()
        await submit
        stats = unpack(await decode.stats(), WorkerStats)
        runner = decode.engine.runner
        block = runner.kv_cache[:, 0].numel() * runner.kv_cache.element_size()
        await decode.aengine.stop()
        await prefill.aengine.stop()
        decode.sink.close()
        return Handoff(stats.transfer.bytes, stats.transfer.blocks, held, runner.kv_cache.shape[0], block)

    return asyncio.run(flow())


def expected_gemma_bytes(model: Path, tokens: int, block_size: int, hybrid: bool, element: int) -> int:
    """Every full layer's blocks of the prompt, and each sliding layer's blocks its window reads at the
    first decode step (positions ``tokens - window + 1`` on), times one layer's block."""
    config = load_model_source(model).config
    region = 2 * block_size * config.num_kv_heads * config.head_dim * element
    blocks = -(-tokens // block_size)
    if not hybrid:
        return config.num_layers * blocks * region
    layer_blocks = 0
    for group in kv_groups(config):
        first = group.first_needed(tokens, block_size)
        layer_blocks += len(group.layers) * (blocks - first)
    return layer_blocks * region


def expected_mla_bytes(layers: int, latent: int, tokens: int, block_size: int, element: int) -> int:
    """layers x latent values x element size x the prompt's whole blocks of tokens."""
    return layers * latent * element * -(-tokens // block_size) * block_size


def _report(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    base = EngineConfig(dtype="float32", block_size=bs, max_num_batched_tokens=2048, num_threads=args.threads,
                        kv_cache_memory=args.kv_cache_memory)
    gemma = model_dir(gemma3_config(window=args.window))
    out: dict[str, Any] = {"prompt": args.prompt, "window": args.window, "context": args.context}
    for hybrid in (True, False):
        h = handoff(gemma, dataclasses.replace(base, hybrid_kv=hybrid), args.prompt)
        out[f"gemma3_{'trimmed' if hybrid else 'untrimmed'}"] = dataclasses.asdict(h)
    for hybrid in (True, False):
        h = handoff(gemma, dataclasses.replace(base, hybrid_kv=hybrid), args.context)
        out[f"gemma3_held_{'hybrid' if hybrid else 'full'}"] = sum(h.held_blocks) * h.slots
    mla, gqa = model_dir(mla_config()), model_dir(gqa_config())
    for name, folder in (("mla", mla), ("gqa", gqa)):
        h = handoff(folder, base, args.prompt)
        out[name] = dataclasses.asdict(h) | {"blocks_per_gib": GIB // h.block_bytes}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.handoff_bytes",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens handed off")
    parser.add_argument("--window", type=int, default=512, help="the Gemma-shaped model's sliding window")
    parser.add_argument("--context", type=int, default=8192,
                        help="tokens of the sequence whose blocks are counted")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", type=int, default=2 * GIB,
                        help="each worker's KV budget in bytes")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    args = parser.parse_args(argv)
    print(json.dumps(_report(args), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
