"""The import graph of the project's packages: no import circle, and no import across the layout's
forbidden pairs (docs/architecture.md, "Layout: one folder per process role or shared layer").

Imports are read with ``ast`` from every ``.py`` file of the project packages, never executed. Each edge
is one import statement resolved to the project module it loads: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module and to ``a.b`` otherwise; relative imports are resolved against the file's
package. Edges are of three kinds:

- ``module``: executed at import time (module body, including ``try``/``if`` at module level);
- ``type_checking``: inside an ``if TYPE_CHECKING:`` block;
- ``function``: inside a function or method body (run later, when called).

Every kind counts, for the forbidden pairs and for circles alike. A type-only or lazy import is still a
dependency of the code (the importer is written against the other module's names), and a lazy import is
still loaded in the process that runs it: laziness is no licence to cross a layer, and an import moved
into a function to dodge a circle leaves the circle in the design (two modules that need each other are
one idea, or share a third module both import).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "kernels", "transfer", "messages", "telemetry", "worker", "prefill", "decode", "router",
            "cluster", "cli", "bench", "planner")
WORKER_SIDE = ("worker", "engine", "transfer", "messages", "telemetry")

# package -> what its modules may import from the project. An entry is a package (``engine``: the package and
# every module in it) or one module (``engine.hashing``: that module only).
ALLOWED: dict[str, tuple[str, ...]] = {
    "engine": ("engine", "kernels"),
    "kernels": ("kernels",),
    # the transfer layer may use the message codec (pack/unpack), not the control-plane message types
    "transfer": ("transfer", "messages.codec"),
    # histogram data is a part of WorkerStats
    "messages": ("messages", "engine.sampling_params", "transfer.wire", "telemetry.histogram"),
    "telemetry": ("telemetry",),
    "worker": WORKER_SIDE,
    "prefill": ("prefill", *WORKER_SIDE),
    "decode": ("decode", *WORKER_SIDE),
    # the router process holds no tensors and no model: message and KV wire types, tracing, and from the
    # engine only the prompt hashing, the tokenizer and the sampling parameters it shares with the workers
    "router": ("router", "messages", "transfer.wire", "telemetry", "engine.hashing", "engine.tokenizer",
               "engine.sampling_params", "engine.grammar"),
    "cluster": tuple(p for p in PACKAGES if p not in ("cli", "bench")),
    "cli": PACKAGES,
    # the load generator, the chaos soak and the serving comparisons talk to a server over HTTP only; they
    # share the named workloads' parameters with the simulator. The lab benchmarks are listed below
    "bench": ("bench", "planner.workload_params"),
    # the simulator and its searches are plain Python; the profiler measures an engine and a NIXL read in
    # process
    "planner": ("planner", "engine", "kernels", "transfer", "messages.codec"),
}

# bench modules that load a layer in process, each with the layers it may load: the lab benchmarks
# (``bench/lab/``, one layer each), the GGUF to Hugging Face export the comparisons serve vLLM from, and
# the client's tokenizer. Every other bench module (client, workloads, stats, report, chaos, compare, ...)
# is the load generator, the chaos soak or the serving comparisons, and follows ALLOWED["bench"].
IN_PROCESS_BENCHMARKS: dict[str, tuple[str, ...]] = {
    "bench.export_hf": ("engine",),
    "bench.tokenizer": ("engine.loader",),  # the client's tokenizer, from the model's local files
    "bench.lab.offline": ("engine",),
    "bench.lab.closed_loop": ("engine",),
    "bench.lab.ray_items": ("messages",),  # the cost of Ray stream items carrying the worker's messages
    "bench.lab.tensor_parallel": ("engine",),
    "bench.lab.preemption": ("engine",),
    "bench.lab.structured": ("engine",),
    "bench.lab.structured_stop": ("engine",),
    "bench.lab.sampling": ("engine",),
    "bench.lab.kv_offload": ("engine",),
    "bench.lab.kv_window": ("engine",),
    "bench.lab.kv_quant": ("engine", "kernels"),
    "bench.lab.kv_long_quality": ("engine", "kernels"),
    "bench.lab.eviction_cost": ("engine",),
    "bench.lab.linear_kernels": ("engine", "kernels"),
    "bench.lab.block_products": ("kernels", "engine.checkpoint_quant"),
    "bench.lab.kernel_ab": ("kernels", "engine"),  # two builds of the native kernels in one process
    "bench.lab.sim_validation": ("planner",),  # a run's step clocks priced with a profile, after the run
    "bench.lab.step_ops": ("engine", "kernels"),
    "bench.lab.step_profile": ("engine", "kernels"),
    "bench.lab.moe_step": ("engine",),
    "bench.lab.requantize": ("engine",),  # the default model's path
    "bench.lab.weight_quality": ("engine",),
    "bench.lab.mla_step": ("engine",),
    "bench.lab.mla_attention": ("kernels",),
    "bench.lab.moe_models": ("engine.loader",),  # the cache folder the models are saved under
    "bench.lab.handoff_bytes": ("engine", "messages", "prefill.worker", "decode.worker"),  # in process
    "bench.lab.gpu": ("engine", "kernels", "transfer", "messages.codec"),
    "bench.lab.first_light": ("engine",),  # bench.lab.gpu's steps in child processes, within a deadline
    "bench.lab.transfer": ("transfer", "messages.codec"),
    "bench.lab.tp_transfer": ("engine", "worker.tp_kv", "transfer"),
    "bench.lab.disagg": ("router", "cluster.workers", "engine", "messages"),
    "bench.lab.router_overhead": ("router", "cluster", "engine", "messages"),
}

# Imports that cross a forbidden pair in the tree today, each to be removed by the change that moves the
# code to its layer. An edge not listed here fails ``test_no_import_across_forbidden_pairs``; an edge listed
# here that no longer exists fails ``test_known_violations_are_still_present`` (delete it from this set).
KNOWN_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()

# Import edges that close a circle in the tree today, left out of the circle check until the change that
# cuts the circle; like KNOWN_VIOLATIONS, an edge listed here that no longer exists fails a test.
@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    kind: str  # "module", "type_checking" or "function"
    path: Path
    line: int

    def __str__(self) -> str:
        where = f"{self.path.relative_to(ROOT)}:{self.line}"
        return f"{self.importer} -> {self.imported} ({self.kind} import, {where})"


@cache
def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``node`` with its kind, without entering nested scopes twice."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, kind
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _imports(child, "function")
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), kind)
        else:
            yield from _imports(child, kind)


def _targets(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    modules = project_modules()
    if isinstance(stmt, ast.Import):
        names = [alias.name for alias in stmt.names]
    elif stmt.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - stmt.level + 1]
        names = [".".join([*base, stmt.module] if stmt.module else base)]
    else:
        names = [stmt.module or ""]
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        if isinstance(stmt, ast.ImportFrom):
            submodules = [f"{name}.{alias.name}" for alias in stmt.names if f"{name}.{alias.name}" in modules]
            if submodules:
                yield from submodules
                continue
        yield name


@cache
def edges() -> tuple[Edge, ...]:
    found: list[Edge] = []
    for module, path in project_modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for stmt, kind in _imports(tree, "module"):
            for target in _targets(stmt, module, path.name == "__init__.py"):
                if target != module:
                    found.append(Edge(module, target, kind, path, stmt.lineno))
    return tuple(found)


def _covered(target: str, entries: tuple[str, ...]) -> bool:
    return any(target == entry or target.startswith(entry + ".") for entry in entries)


def allowed(importer: str, imported: str) -> bool:
    package = importer.split(".")[0]
    if _covered(imported, ALLOWED[package]):
        return True
    return _covered(imported, IN_PROCESS_BENCHMARKS.get(importer, ()))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_every_package_has_a_rule_and_every_benchmark_exists() -> None:
    modules = project_modules()
    assert set(ALLOWED) == set(PACKAGES)
    assert all(p in modules for p in PACKAGES)  # the walk found the tree (a wrong ROOT would find nothing)
    missing = [m for m in IN_PROCESS_BENCHMARKS if m not in modules]
    assert not missing, f"IN_PROCESS_BENCHMARKS names modules that do not exist: {missing}"


def test_import_walk_sees_every_kind() -> None:
    """The walker resolves the three kinds of import that the rules rely on (checked on the tree itself)."""
    kinds = {(e.importer, e.imported): e.kind for e in edges()}
    assert kinds[("engine", "engine.config")] == "type_checking"
    assert kinds[("bench.tokenizer", "engine.loader")] == "function"
    assert kinds[("decode.worker", "worker.base")] == "module"


def import_graph() -> dict[str, set[str]]:
    """Every module and what it imports, every kind of import (module level, lazy, type-only)."""
    graph: dict[str, set[str]] = {m: set() for m in project_modules()}
    for edge in edges():
        graph[edge.importer].add(edge.imported)
    return graph


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    where = {(e.importer, e.imported): f"{e.kind} import, {e.path.relative_to(ROOT)}:{e.line}"
             for e in edges()}
    steps = [f"{a} -> {b} ({where[(a, b)]})" for a, b in itertools.pairwise(cycle or [])]
    assert cycle is None, "import circle (lazy and type-only imports count):\n" + "\n".join(steps)


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_no_import_across_forbidden_pairs() -> None:
    bad = [e for e in edges() if not allowed(e.importer, e.imported)
           and (e.importer, e.imported) not in KNOWN_VIOLATIONS]
    assert not bad, "imports across the layout's forbidden pairs:\n" + "\n".join(map(str, bad))


def test_known_violations_are_still_present() -> None:
    present = {(e.importer, e.imported) for e in edges() if not allowed(e.importer, e.imported)}
    fixed = sorted(KNOWN_VIOLATIONS - present)
    assert not fixed, f"fixed, so remove them from KNOWN_VIOLATIONS: {fixed}"


@pytest.mark.parametrize(("importer", "imported", "ok"), [
    ("engine.models.causal_lm", "router.client", False),
    ("engine.models.causal_lm", "kernels.rope", True),
    ("router.client", "engine.hashing", True),
    ("router.client", "engine.models.causal_lm", False),
    ("router.app", "transfer.nixl_sink", False),
    ("prefill.worker", "decode.worker", False),
    ("cluster.workers", "cli.main", False),
    ("cli.main", "cli.bench", True),
    ("bench.client", "router.client", False),
    ("bench.lab.disagg", "router.client", True),
    ("bench.lab.transfer", "router.client", False),
    ("bench.client", "planner.workload_params", True),
    ("bench.client", "planner.simulator", False),
    ("planner.workload", "bench.workloads", False),
])
def test_rule_table(importer: str, imported: str, ok: bool) -> None:
    assert allowed(importer, imported) is ok
