"""The load generator's tokenizer: the served model's own, read from its local files (prompt sizes in tokens).

The one bench module besides the in-process benchmarks that reads model files (never weights).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def load_tokenizer(path: str | None) -> Any:
    """The tokenizer of the model at ``path`` (default: the built-in model), loaded once per process."""
    from engine.loader import load_model_source, resolve_model

    return load_model_source(resolve_model(path)).load_tokenizer()
