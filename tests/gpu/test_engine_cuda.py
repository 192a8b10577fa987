"""The engine on a CUDA device agrees with the CPU engine (skipped without CUDA)."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import default_model_path

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


def test_float32_greedy_on_cuda_equals_cpu() -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    model = str(default_model_path())
    cpu = LLM(model=model, dtype="float32").generate(PROMPTS, params)
    gpu_llm = LLM(model=model, dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    gpu = gpu_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
