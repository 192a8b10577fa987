"""Heavy-hitter KV eviction (``--kv-eviction h2o``, ``engine/kv_eviction.py``): the scores, the choice of
block, a planted heavy hitter that survives where a window loses it, the budget held for a whole run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from kernels import TorchAttentionBackend, kv_int4
from kernels.cpu_native import NativeCpuAttentionBackend, native_available
from tests.unit.attention_cases import attention_backend, make_case, quantized_cache
from tests.unit.conftest import save_word_tokenizer

VOCAB = 64
HEAVY = (60, 61)  # tokens every query attends to; each carries its own answer
ANSWER = {60: 10, 61: 11}
FILLER = (12, 60)  # ids of the ordinary tokens


def blank_llama(heads: int, head_dim: int) -> LlamaForCausalLM:
    """A one-layer Llama of ``heads`` query and KV heads of ``head_dim`` over a 64-wide hidden state, every
    weight zero but: hidden dimension 0 a constant 4 in every token's embedding, random dimensions 8 and up
    for every token (the fillers' identity) and in the LM head's rows from 12 on (which the head reads for
    filler tokens), and the norms one. The model that sets its attention weights decides what it does."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        embed = model.model.embed_tokens.weight
        embed[:, 8:] = torch.randn(VOCAB, 56, generator=gen)
        embed[:, 0] = 4.0
        layer = model.model.layers[0]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        model.lm_head.weight[12:, 8:] = torch.randn(VOCAB - 12, 56, generator=gen)
    return model


def heavy_hitter_model(folder: Path) -> None:
    """A one-layer Llama whose every query attends almost only to a ``HEAVY`` token, if one is in view,
    and whose next token is then that heavy token's ``ANSWER`` (else some filler token).

    Hidden dimension 0 is a constant every token has: the query reads it into head dimension 31, whose
    rotary frequency is ~1e-6 (positions barely turn it). A heavy token has a large dimension 1, which
    the key reads into dimension 31: only heavy keys score. Dimensions 2/3 name the heavy token; V
    carries them, O writes them to dimensions 4/5, and the head reads 4/5 as the two answers. The MLP
    is zero; filler tokens have random dimensions 8 and up, which the head reads for every other token.
    """
    model = blank_llama(1, 64)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        for i, token in enumerate(HEAVY):
            embed[token, 1] = 8.0
            embed[token, 2 + i] = 8.0
        layer = model.model.layers[0]
        layer.self_attn.q_proj.weight[31, 0] = 6.0
        layer.self_attn.k_proj.weight[31, 1] = 6.0
        layer.self_attn.v_proj.weight[0, 2] = 1.0
        layer.self_attn.v_proj.weight[1, 3] = 1.0
        layer.self_attn.o_proj.weight[4, 0] = 40.0
        layer.self_attn.o_proj.weight[5, 1] = 40.0
        head = model.lm_head.weight
        head[ANSWER[60], 4] = 8.0
        head[ANSWER[61], 5] = 8.0
    model.save_pretrained(str(folder), safe_serialization=True)
    save_word_tokenizer(folder, VOCAB)


@pytest.fixture(scope="module")
def heavy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("heavy")
    heavy_hitter_model(folder)
    return folder


def planted(heavy: int, at: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(*FILLER, (length,), generator=gen).tolist()
    ids[at] = heavy
    return ids


@pytest.mark.parametrize("backend_name", ["torch", "native"])
def test_mass_is_the_attention_each_block_received(backend_name: str) -> None:
    """Per block, layer and KV head: the softmax probabilities its keys got from the KV head's query heads,
    summed over them and the step's queries, from a dense computation; a block written from its first
    row starts again; the second forward of a step is the second layer's columns. The torch kernel forms
    them in its product, the native CPU kernels in a second pass over the keys."""
    bs, heads, kv_heads, dim = 4, 4, 2, 16
    case = make_case([1, 5, 1], [9, 12, 4], heads, kv_heads, dim, bs, seed=3)
    mass = torch.full((case.kv.shape[0], 2 * kv_heads), 7.0)
    backend = attention_backend(backend_name, mass)
    backend.prepare(case.meta)
    lens = zip(case.tables, case.meta.seq_lens_list, case.meta.query_lens_list, strict=True)
    restarted = {t[p // bs] for t, s, q in lens for p in range(s - q, s) if p % bs == 0}
    assert restarted
    for blk in restarted:
        assert (mass[blk] == 0.0).all()
    kv = case.kv.clone()
    backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5)
    backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5)  # the second layer, its own columns
    want = torch.full_like(mass, 7.0)
    for blk in restarted:
        want[blk] = 0.0
    for seq, table in enumerate(case.tables):
        s_len, q_len = case.meta.seq_lens_list[seq], case.meta.query_lens_list[seq]
        start = sum(case.meta.query_lens_list[:seq])
        k = case.full_k[seq].repeat_interleave(heads // kv_heads, dim=1)  # [L, heads, dim]
        q = case.q[start : start + q_len]  # [q_len, heads, dim]
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * dim**-0.5
        pos = torch.arange(s_len)
        visible = pos[None, :] <= (s_len - q_len + torch.arange(q_len))[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        per_key = probs.reshape(kv_heads, -1, s_len).sum(dim=1)  # [kv_heads, keys]: each group's query heads
        for i, blk in enumerate(table):
            got = per_key[:, i * bs : (i + 1) * bs].sum(dim=1).float()
            want[blk] += torch.cat((got, got))  # two layers, the same inputs
    torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=str)
def test_mass_over_a_quantized_cache_counts_each_query_own_exact_key(dtype: torch.dtype,
                                                                      backend_name: str) -> None:
    """Over a quantized cache a prompt chunk's query attends to the earlier tokens as stored and to its
    own K exactly (``_attend_own_exact``); its probabilities, the own key's included, go to the blocks
    the keys' positions lie in, as a dense computation over those keys gives. Every query head's
    probabilities sum to one, so the mass added is heads x queries."""
    from kernels.kv_quant import dequantize

    bs, heads, kv_heads, dim = 4, 4, 2, 16
    case = make_case([6, 1, 3], [6, 9, 7], heads, kv_heads, dim, bs, seed=5)
    kv, scales = quantized_cache(case, dtype)  # earlier tokens already in the cache, as stored codes
    mass = torch.zeros(case.kv.shape[0], kv_heads)
    backend = attention_backend(backend_name, mass)
    backend.prepare(case.meta)
    backend.forward(case.q, case.new_k, case.new_v, kv, dim**-0.5, scales)
    assert float(mass.sum()) == pytest.approx(heads * sum(case.meta.query_lens_list), rel=1e-5)

    want = torch.zeros_like(mass)
    start = 0
    for seq, table in enumerate(case.tables):
        s_len, q_len = case.meta.seq_lens_list[seq], case.meta.query_lens_list[seq]
        pos = torch.arange(s_len)
        blocks = torch.tensor(table)[pos // bs]
        k_stored = dequantize(kv[blocks, 0, pos % bs], scales[blocks, 0][:, :, None]).double()
        for i in range(q_len):
            p = s_len - q_len + i
            k = torch.cat((k_stored[:p], case.full_k[seq][p : p + 1].double()))  # [p + 1, kv_heads, dim]
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            q = case.q[start + i].double()  # [heads, dim]
            probs = torch.softmax(torch.einsum("hd,khd->hk", q, k) * dim**-0.5, dim=-1)
            want.index_add_(0, blocks[: p + 1], probs.reshape(kv_heads, -1, p + 1).sum(dim=1).t().float())
        start += q_len
    torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["float32", "int8", "int4"])
def test_native_kernels_score_blocks_as_the_torch_kernel(name: str) -> None:
    """Decodes, short chunks and chunks long enough for the blocked kernel, over GQA: the native kernels'
    masses equal the torch kernel's to float rounding, over a float32 or quantized cache."""
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    case = make_case([1, 9, 1, 21, 40], [37, 41, 16, 21, 70], heads, kv_heads, dim, bs, seed=5)
    if name == "float32":
        kv, scales = case.kv, None
    else:
        kv, scales = quantized_cache(case, torch.int8 if name == "int8" else kv_int4.STORAGE_DTYPE)
    # two layers' columns; the forward is layer 0's, so layer 1's stay as they were
    start = torch.rand(case.kv.shape[0], 2 * kv_heads, generator=torch.Generator().manual_seed(0))
    masses = []
    for backend_name in ("torch", "native"):
        mass = start.clone()
        backend = attention_backend(backend_name, mass)
        backend.prepare(case.meta)
        backend.forward(case.q, case.new_k, case.new_v, kv.clone(), dim**-0.5,
                        None if scales is None else scales.clone())
        masses.append(mass)
    assert not torch.equal(masses[1][:, :kv_heads], start[:, :kv_heads])
    untouched = masses[1][:, kv_heads:]  # as they were, or zero in blocks written from their first row
    assert torch.equal(untouched, masses[0][:, kv_heads:])
    assert ((untouched == start[:, kv_heads:]).all(dim=1) | (untouched == 0).all(dim=1)).all()
    torch.testing.assert_close(masses[1], masses[0], atol=2e-4, rtol=1e-5)


def test_the_least_attended_full_block_outside_the_recent_window_goes(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_eviction="h2o", kv_budget=64, kv_recent=8, num_kv_blocks=32,
              max_num_batched_tokens=48)
    engine = llm.engine
    assert engine.eviction is not None and engine.runner.kv_mass is not None
    backend = engine.runner.backend
    assert isinstance(backend, (NativeCpuAttentionBackend, TorchAttentionBackend))
    assert backend.mass is engine.runner.kv_mass  # the step's backend scores the blocks
    assert isinstance(backend, NativeCpuAttentionBackend) == native_available()
    from engine.request import Request

    request = Request("r", list(range(1, 60)), SamplingParams(max_tokens=4))
    assert engine.kv.allocate("r", 48)
    request.num_computed_tokens = 48
    table = engine.kv.blocks_of("r")
    assert engine.runner.kv_mass is not None
    width = engine.runner.kv_mass.shape[1]
    engine.runner.kv_mass[torch.tensor(table)] = torch.tensor([5.0, 1.0, 3.0])[:, None] / width
    # 48 held + 32 new > 64: blocks 0 and 1 lie wholly before the last 8 tokens, and one must go
    n = engine.eviction.fit(engine.kv, request, 32)
    assert engine.kv.blocks_of("r") == [table[0], table[2]]  # block 1 had the least mass
    assert request.kv_dropped_tokens == 16 and n == 32 and engine.eviction.evicted_tokens == 16
    n = engine.eviction.fit(engine.kv, request, 40)  # 32 held: only block 0 lies before the last 8
    assert engine.kv.blocks_of("r") == [table[2]] and n == 40 and request.kv_tokens == 16
    engine.kv.free("r")


@pytest.mark.parametrize("heavy", HEAVY)
def test_a_planted_heavy_hitter_survives_where_a_window_loses_it(heavy_dir: Path, heavy: int) -> None:
    """The answer needs the heavy token, 200 tokens back in a 400-token prompt: the full cache, H2O and
    head-wise (budget 128) answer it on every token; StreamingLLM's sinks and window (same budget) lose it
    and never do. Both hold at most 128 tokens (+ the block being filled) after every step, and every
    block is back in the pool afterwards."""
    prompt = planted(heavy, 200, 400, seed=heavy)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(num_kv_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    full = LLM(str(heavy_dir), **common).generate([prompt], params)[0].token_ids  # type: ignore[arg-type]
    assert full == [ANSWER[heavy]] * 24
    window = LLM(str(heavy_dir), kv_sinks=16, kv_window=112, **common)  # type: ignore[arg-type]
    lost = window.generate([prompt], params)[0].token_ids
    assert ANSWER[heavy] not in lost

    for policy in ("h2o", "headwise"):
        llm = LLM(str(heavy_dir), kv_eviction=policy, kv_budget=128, **common)  # type: ignore[arg-type]
        engine = llm.engine
        request = engine.add_request(prompt, params)
        request_id = request.request_id
        held: list[int] = []
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens = out.token_ids
            if request_id in engine.kv._owners:
                held.append(len(engine.kv.blocks_of(request_id)))
        assert tokens == full, policy
        assert max(held) <= 128 // 16 + 1 and engine.stats().kv_evicted_tokens >= 400 - 128
        assert (request.metrics.kv_evicted_tokens == engine.stats().kv_evicted_tokens
                == request.kv_dropped_tokens)
        if policy == "headwise":  # one layer's one KV head: 90% of its mass lies in the heavy token's block
            # and at most one more (the queries before the heavy token spread theirs)
            (budget,) = request.metrics.kv_head_budgets
            assert 16 <= budget <= 32
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_h2o_over_a_quantized_cache_keeps_the_heavy_hitter(heavy_dir: Path, kv_dtype: str) -> None:
    """Both compressions at once: H2O (budget 128) over int8 or int4 KV still answers from the heavy
    token planted 200 tokens back, holds the budget after every step and frees every block."""
    prompt = planted(HEAVY[0], 200, 400, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(str(heavy_dir), kv_eviction="h2o", kv_budget=128, kv_cache_dtype=kv_dtype, num_kv_blocks=64,
              max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = llm.engine
    assert engine.runner.kv_scales is not None
    request = engine.add_request(prompt, params)
    held: list[int] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.token_ids
        if request.request_id in engine.kv._owners:
            held.append(len(engine.kv.blocks_of(request.request_id)))
    assert tokens == [ANSWER[HEAVY[0]]] * 16
    assert max(held) <= 128 // 16 + 1 and request.kv_dropped_tokens >= 400 - 128
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_eviction_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="--kv-eviction h2o needs --kv-budget"):
        EngineConfig(kv_eviction="h2o")
    with pytest.raises(ValueError, match="--kv-eviction must be one of none, h2o, headwise"):
        EngineConfig(kv_eviction="snapkv")
    with pytest.raises(ValueError, match="--kv-budget and --kv-recent need --kv-eviction h2o"):
        EngineConfig(kv_budget=256)
    with pytest.raises(ValueError, match="must exceed --kv-recent"):
        EngineConfig(kv_eviction="h2o", kv_budget=64, kv_recent=48)
    assert EngineConfig(kv_eviction="h2o", kv_budget=256, kv_cache_dtype="int4").kv_quantized
    with pytest.raises(ValueError, match="does not combine with --kv-window"):
        EngineConfig(kv_eviction="h2o", kv_budget=256, kv_window=128)


@pytest.mark.parametrize("scheme", [dict(kv_eviction="h2o", kv_budget=64, kv_recent=16),
                                    dict(kv_eviction="headwise", kv_budget=64, kv_recent=16),
                                    dict(kv_window=32, kv_sinks=16)], ids=["h2o", "headwise", "window"])
def test_a_compressed_sequence_handed_over_goes_on_as_colocated(tiny_model_dir: Path,
                                                                 scheme: dict[str, object]) -> None:
    """The engine's half of the disaggregated handoff of a compressed sequence (the workers' half:
    tests/integration/test_disagg_compressed.py): a "prefill" engine computes the prompt in chunks and
    holds its kept blocks (``held_kv``); a "decode" engine reserves at most ``compressed_bound`` tokens,
    fits the reservation to the kept blocks (``compress_reservation``), takes their bytes and (H2O)
    their mass, and its tokens equal those of the whole request run on one engine."""
    common = dict(num_kv_blocks=48, max_num_batched_tokens=32, **scheme)
    prompt = [1 + (i * 7) % 90 for i in range(150)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    local = LLM(str(tiny_model_dir), **common).generate([prompt], params)[0].token_ids  # type: ignore[arg-type]

    prefill = LLM(str(tiny_model_dir), **common).engine  # type: ignore[arg-type]
    first = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                hold_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    held = prefill.held_kv(first.request_id)
    kept = len(prompt) - held.dropped_tokens
    assert held.dropped_tokens > 0 and len(held.tables[0]) == -(-kept // 16)
    width = prefill.runner.kv_mass.shape[1] if prefill.runner.kv_mass is not None else 0
    assert len(held.block_mass) == len(held.tables[0]) * width

    decode = LLM(str(tiny_model_dir), **common).engine  # type: ignore[arg-type]
    request = decode.make_request(prompt, params)
    bound = decode.compressed_bound()
    assert bound is not None and len(prompt) > bound >= kept
    reservation = decode.reserve(request)
    assert reservation is not None and len(reservation.block_ids) == -(-(bound + 1) // 16)
    reservation = decode.compress_reservation(request.request_id, kept, held.dropped_tokens)
    assert reservation is not None and len(reservation.block_ids) == -(-(kept + 1) // 16)
    src, dst = torch.tensor(held.tables[0]), torch.tensor(reservation.block_ids[: len(held.tables[0])])
    decode.runner.kv_cache[:, dst] = prefill.runner.kv_cache[:, src]
    decode.start_prefilled(request.request_id, first.output_token_ids[0], block_mass=held.block_mass)
    assert request.kv_dropped_tokens == held.dropped_tokens and request.kv_tokens == kept
    if decode.eviction is not None:
        assert decode.eviction.mass[dst].flatten().tolist() == held.block_mass
    tokens = [first.output_token_ids[0]]
    while decode.has_unfinished():
        for out in decode.step():
            tokens = out.token_ids
    assert tokens == local
    prefill.release_kv(first.request_id)
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
