"""A worker's measured costs on one machine: the numbers the simulator and the planner run on.

A profile is a versioned JSON file (``PROFILE_VERSION``) written by ``pdserve profile`` (or by hand, for
a machine we only have published figures for, with ``notes`` naming them). It holds the machine and
the model it was measured with, three fitted cost models and the samples they were fitted to:

- prefill step: ``base_s + per_token_s * N + per_attended_s * A`` seconds, where ``N`` is the prompt
  tokens the step computes and ``A`` the attention pairs: a chunk of ``n`` tokens after ``k`` tokens
  already in the KV cache (computed earlier or a prefix-cache hit) attends ``n * (k + (n + 1) / 2)``
  key positions. Cached tokens cost nothing but the attention they add.
- decode step: ``base_s + per_seq_s * B + per_context_s * C`` seconds for ``B`` running requests
  holding ``C`` tokens of context in all; with ``by_batch`` (the step at each measured batch size, no
  context), ``by_batch(B) + per_context_s * C`` instead, interpolated linearly between the measured
  sizes (and past the largest along its last segment): a step's cost is not linear in the batch (with
  torch's default product a batch of 2 took twice a batch of 1, and batches 2 to 8 about the same).
  ``base_s`` and ``per_seq_s`` stay the straight-line fit, for what needs a slope.
- KV transfer: ``base_s + bytes / bytes_per_s`` seconds for one pull of ``bytes`` of KV.

``request_overhead_s`` is the fixed latency a request pays outside the engines before its first token
(HTTP, router, the Ray calls); the simulator adds it to every time to first token.
Workers that share one host's CPU (set by ``pdserve profile --calibrate``; ``planner/simulator.py``
has the model), two terms:

- ``host_cores``: the effective cores they share; a step's wall time stretches by busy workers /
  ``host_cores`` while that is above 1 (the wait for a core). None: no wait, each worker has its own
  device. ``prefill_host_cores``: a figure of its own for prefill steps (None: ``host_cores``).
- ``decode_contention`` and ``prefill_contention`` (at least 1): how much more CPU time a step of that
  role needs while a worker of the other role computes (shared caches and memory bandwidth).

The calibration fits them so that simulating its own load on the server reproduces what the workers'
step clocks measured under it: wall over CPU time for the wait, and CPU time over what these costs
price the same steps at (the costs are one worker's alone) for each role's contention.

The contract with the live planner (``cluster/``): ``Profile``, ``load_profile`` and ``save_profile``
keep these names and meanings; a new field gets a default, a changed meaning a new version.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

PROFILE_VERSION = 1


@dataclass(frozen=True)
class MachineInfo:
    """Where the profile was measured (or, for a scaled profile, the machine it stands for)."""

    hostname: str
    platform: str
    processor: str
    cpu_count: int
    device: str
    torch_threads: int


@dataclass(frozen=True)
class ModelInfo:
    """The model and the engine limits the workers ran with.

    ``chat_user_tokens``: tokens the chat template adds to a lone user message (a default system prompt
    included); ``chat_system_tokens``: tokens it adds to a system and a user message;
    ``chat_shared_tokens``: leading tokens every lone-user chat prompt shares (the default system
    prompt), which the prefix cache serves after the first request."""

    name: str
    dtype: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    chat_user_tokens: int = 0
    chat_system_tokens: int = 0
    chat_shared_tokens: int = 0


def _check_costs(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{owner}.{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class PrefillCost:
    base_s: float
    per_token_s: float
    per_attended_s: float

    def __post_init__(self) -> None:
        _check_costs("prefill", base_s=self.base_s, per_token_s=self.per_token_s,
                     per_attended_s=self.per_attended_s)

    def step_s(self, new_tokens: int, attended: float) -> float:
        """Seconds of one step computing ``new_tokens`` prompt tokens with ``attended`` attention pairs."""
        return self.base_s + self.per_token_s * new_tokens + self.per_attended_s * attended

    def prompt_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of one step computing a whole prompt's ``new_tokens`` after ``cached_tokens``."""
        return self.step_s(new_tokens, attended_pairs(new_tokens, cached_tokens))


def attended_pairs(new_tokens: int, context_tokens: int) -> float:
    """Key positions ``new_tokens`` causal queries after ``context_tokens`` KV entries attend in all."""
    return new_tokens * (context_tokens + (new_tokens + 1) / 2)


@dataclass(frozen=True)
class DecodeCost:
    base_s: float
    per_seq_s: float
    per_context_s: float
    by_batch: tuple[tuple[int, float], ...] = ()  # (batch, seconds of a step without context), ascending

    def __post_init__(self) -> None:
        _check_costs("decode", base_s=self.base_s, per_seq_s=self.per_seq_s, per_context_s=self.per_context_s)
        batches = [b for b, _ in self.by_batch]
        if len(batches) == 1 or batches != sorted(set(batches)) or (batches and batches[0] < 1):
            raise ValueError(f"decode.by_batch must list 2 or more batch sizes >= 1 in ascending order, got "
                             f"{batches}")
        _check_costs("decode.by_batch", **{str(b): s for b, s in self.by_batch})

    def batch_s(self, batch: float) -> float:
        """The step's cost at ``batch`` requests without context."""
        points = self.by_batch
        if not points:
            return self.base_s + self.per_seq_s * batch
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in zip(points, points[1:], strict=False):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (batch - b1)

    def step_s(self, batch: int, context_tokens: int) -> float:
        return self.batch_s(batch) + self.per_context_s * context_tokens

    def plus(self, seconds: float) -> DecodeCost:
        """This cost with ``seconds`` more on every step (the base and every batch size's figure)."""
        return dataclasses.replace(self, base_s=self.base_s + seconds,
                                   by_batch=tuple((b, t + seconds) for b, t in self.by_batch))


@dataclass(frozen=True)
class TransferCost:
    base_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        _check_costs("transfer", base_s=self.base_s)
        if not self.bytes_per_s > 0:
            raise ValueError(f"transfer.bytes_per_s must be > 0, got {self.bytes_per_s}")

    def seconds(self, nbytes: int) -> float:
        return self.base_s + nbytes / self.bytes_per_s if nbytes > 0 else self.base_s


@dataclass(frozen=True)
class PrefillSample:
    new_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True)
class TransferSample:
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Profile:
    """One worker's costs on one machine (see the module docstring). ``notes``: how it was made (for a
    scaled profile, the published figures and their sources)."""

    machine: MachineInfo
    model: ModelInfo
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    request_overhead_s: float = 0.0
    host_cores: float | None = None
    version: int = PROFILE_VERSION
    created: str = ""
    notes: str = ""
    prefill_host_cores: float | None = None
    decode_contention: float = 1.0
    prefill_contention: float = 1.0
    prefill_samples: tuple[PrefillSample, ...] = field(default_factory=tuple)
    decode_samples: tuple[DecodeSample, ...] = field(default_factory=tuple)
    transfer_samples: tuple[TransferSample, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version} is not supported (this pdserve reads "
                             f"version {PROFILE_VERSION}); run `pdserve profile` again")
        _check_costs("profile", request_overhead_s=self.request_overhead_s)
        for name in ("host_cores", "prefill_host_cores"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"profile.{name} must be > 0 or null, got {value}")
        for name in ("decode_contention", "prefill_contention"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"profile.{name} must be >= 1, got {getattr(self, name)}")
        m = self.model
        for name in ("kv_bytes_per_token", "block_size", "kv_capacity_tokens", "max_num_batched_tokens",
                     "max_num_seqs"):
            if getattr(m, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(m, name)}")


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as indented JSON (atomically: a temporary file renamed over ``path``)."""
    path = Path(path)
    data = msgspec.json.format(msgspec.json.encode(profile), indent=2)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data + b"\n")
    tmp.replace(path)


def load_profile(path: str | Path) -> Profile:
    """Read a profile; ``FileNotFoundError`` when missing, ``ValueError`` naming the file and the field
    that is wrong (or the version that is not supported) otherwise."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return msgspec.json.decode(data, type=Profile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"profile {path}: {exc}") from None
