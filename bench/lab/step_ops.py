"""Split one forward pass into op classes with torch.profiler.

Each profiled op's self time goes to the class of its nearest labelled ancestor
(itself included): ranges named ``attention`` (the backend's ``forward``),
``norm`` / ``rope`` / ``act`` (``apply_rotary`` as ``engine.layers.attention`` calls it, and the
native fused ops of ``kernels.native_ops``),
``gemm`` (the native one-row product) and GEMM ops by name; the rest is ``other``.
Self times partition the profiled time, so the classes add up to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import engine.layers.attention as attention_module
from kernels.attention import AttentionBackend
from kernels.native_ops import native_ops

OP_CLASSES = ("gemm", "attention", "norm_rope_act", "other")
_LABELS = {"attention": "attention", "norm": "norm_rope_act", "rope": "norm_rope_act", "act": "norm_rope_act",
           "gemm": "gemm"}
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkl::_mkl_linear",
                       "mkldnn::_linear_pointwise"})


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def labels(backend: AttentionBackend) -> Iterator[None]:
    """Label the model's norm, rope, activation and attention calls for the profiler."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(attention_module, "apply_rotary",
                                              _labelled("rope", attention_module.apply_rotary)))
        stack.enter_context(mock.patch.object(backend, "forward", _labelled("attention", backend.forward)))
        ops = native_ops()
        if ops is not None:
            for name, label in (("add_rms_norm", "norm"), ("rope_", "rope"), ("silu_mul", "act"),
                                ("linear", "gemm")):
                stack.enter_context(mock.patch.object(ops, name, _labelled(label, getattr(ops, name))))
        yield


def _class_of(event: Any) -> str:
    node = event
    while node is not None:
        if node.name in _LABELS:
            return _LABELS[node.name]
        if node.name in _GEMM_OPS:
            return "gemm"
        node = node.cpu_parent
    return "other"


def op_class_split(fn: Callable[[], object], backend: AttentionBackend | None = None) -> dict[str, float]:
    """Profiled seconds of one ``fn()`` per op class (labels applied when ``backend`` is given)."""
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(labels(backend))
        with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
            fn()
    split = dict.fromkeys(OP_CLASSES, 0.0)
    for event in prof.events():
        split[_class_of(event)] += event.self_cpu_time_total / 1e6
    return split
