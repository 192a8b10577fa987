"""Where workers run: one Ray placement group per worker, on the nodes its role's resources select.

A worker's group is one bundle (``STRICT_PACK``: one node): the worker's CPUs, its custom
resources (``--prefill-resources`` / ``--decode-resources``, e.g. ``prefill_node=1``, which
only the nodes started with that resource offer; ``--prefill-labels`` / ``--decode-labels``
select nodes by Ray node labels instead or as well) and, when the engine runs on CUDA, one
GPU per tensor-parallel rank (``--prefill-tp`` / ``--decode-tp``): the actor is rank 0 and
starts the other ranks as its own processes (``worker/base.py``), so Ray gives the actor all
``tp`` GPUs (``CUDA_VISIBLE_DEVICES`` lists them, rank r takes ``cuda:r``). The actor is
scheduled into that bundle, so a restarted actor returns to the same reservation. Groups are
created by the driver and removed with it (they are never detached), so nothing outlives
``pdserve serve``.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

_RESOURCE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")
RESERVED = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def parse_resources(text: str, flag: str = "--resources") -> dict[str, float]:
    """``name=amount[,...]`` (amount defaults to 1) -> ``{name: amount}``; ValueError names ``flag``."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, amount = part.partition("=")
        name = name.strip()
        if not _RESOURCE_RE.match(name):
            raise ValueError(f"{flag}: invalid resource name {name!r}")
        if name in RESERVED:
            raise ValueError(f"{flag}: {name} is set by --worker-cpus / --device, not as a custom resource")
        try:
            value = float(amount) if amount.strip() else 1.0
        except ValueError:
            raise ValueError(f"{flag}: invalid amount {amount!r} for {name!r}") from None
        if value <= 0:
            raise ValueError(f"{flag}: amount for {name!r} must be > 0")
        out[name] = value
    return out


def parse_labels(text: str, flag: str = "--labels") -> dict[str, str]:
    """``key=value[,...]`` -> a Ray label selector (values may use Ray's ``!`` / ``in(...)`` operators)."""
    from ray._private.label_utils import validate_label_selector

    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag}: expected key=value, got {part!r}")
        out[key.strip()] = value.strip()
    problem = validate_label_selector(out)
    if problem:
        raise ValueError(f"{flag}: {problem}")
    return out


@dataclass(frozen=True)
class Placement:
    """What one worker of a role reserves."""

    num_cpus: float = 1.0
    num_gpus: int = 0
    tp: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def bundles(self) -> list[dict[str, float]]:
        first: dict[str, float] = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            first["GPU"] = float(self.num_gpus * max(self.tp, 1))
        return [first]


@dataclass(frozen=True)
class WorkerOptions:
    """Placement and behaviour of one role's workers. The defaults are ``pdserve serve``'s (its flags
    read them here); ``UNPLACED`` is the bare start of tests and benches."""

    num_cpus: float = 1.0
    num_gpus: int = 0
    resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = 3
    torch_threads: int = 0  # 0: one per whole Ray CPU reserved (``threads``)
    tp: int = 0  # ranks per worker; 0: the engine config's tensor_parallel_size
    placement_groups: bool = True
    placement_timeout: float = 300.0
    resources_flag: str = "--resources"
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def threads(self) -> int:
        """torch threads in each worker: ``torch_threads``, or (0) one per whole CPU it reserves, at least
        one, so a worker computes on exactly the cores Ray holds for it (``--worker-cpus 2``: two)."""
        return self.torch_threads or max(1, int(self.num_cpus))

    def placement(self) -> Placement:
        return Placement(self.num_cpus, self.num_gpus, self.tp, dict(self.resources), dict(self.labels))

    @property
    def actor_gpus(self) -> int:
        """GPUs the worker's actor holds: one per tensor-parallel rank on CUDA."""
        return self.num_gpus * max(self.tp, 1)


UNPLACED = WorkerOptions(max_restarts=0, placement_groups=False)  # no reservation, no restart


def reserve(placement: Placement, name: str, timeout: float, flag: str) -> Any:
    """A ready placement group for one worker; TimeoutError (naming ``flag``) when no node offers it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = placement.bundles()
    selector = [dict(placement.labels) for _ in bundles] if placement.labels else None
    group = placement_group(bundles, strategy="STRICT_PACK", name=name, bundle_label_selector=selector)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        total = ray.cluster_resources()
        raise TimeoutError(
            f"{name}: no node could host {bundles} within {timeout:.0f} s (cluster resources: {total}); "
            f"check {flag}, the role's labels, --worker-cpus and --device")
    return group


def release(groups: list[Any]) -> None:
    """Remove placement groups (ignores ones already gone)."""
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):  # the cluster may already be gone at shutdown
            remove_placement_group(group)


def scheduling(group: Any) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)
