"""Serving costs outside the engine, and how much sharing the host stretches the workers' steps, measured
on a running server.

``pdserve profile --calibrate URL`` does two things on the server at ``URL``:

1. One request at a time (``n`` streaming completions, short prompts, each starting with a different
   word so no prefix-cache hit helps, ``max_tokens`` tokens each), it compares what the client saw
   with what the profile's engine costs predict for an idle cluster:

   - request overhead = median over requests of (TTFT - prefill of its prompt - the KV transfer): HTTP,
     tokenization, the router, the Ray calls and the token's way back;
   - decode step overhead = median gap between two tokens - the decode step of one request: the
     worker's event loop and the stream back, per step. It is added to every decode step
     (``DecodeCost.plus``).

   Both are clipped at zero. With one request in flight no two workers compute at once, so these are
   the serving stack's own costs, never the host's sharing.

2. Under a load of its own (``HostLoad``: ``concurrency`` clients in a closed loop for ``duration_s``
   seconds, each sending prompts of ``input_len`` random token ids from its own seeded generator and
   asking for ``output_len`` tokens), it reads every worker's step clocks and step work from
   ``GET /v1/workers`` before and after (each worker's ``clock``, ``messages.wire.StepStats``: per kind
   of step, its wall seconds and what it computed, ``engine/step_work.py``; ``StepClocks``, the same
   names). The stretch is the decode workers'
   decode-only steps' wall seconds over what the profile's ``DecodeCost`` prices the same steps at
   (steps, rows and context tokens; likewise the prefill workers' prompt-carrying steps over
   ``PrefillCost``): the profile was measured with one worker alone, so the ratio is everything the
   sharing did. It has two parts, which the simulator models apart (``planner/simulator.py``): the
   wait for a core, wall over the stepping thread's CPU seconds (both roles pooled), modelled by
   ``host_cores``; and contention, each role's CPU seconds over the priced ones (two workers computing
   at once are slower at the same arithmetic: shared caches, memory bandwidth), modelled by that
   role's contention while the other role computes. ``fit_host_share`` simulates the same load (the
   server's P:D, the requests' measured lengths) and bisects for the figures at which the simulation
   gives the measured ratios. A ratio under ``MIN_STRETCH`` models nothing (no ``host_cores``, or a
   contention of 1). The steps are priced with the engine's costs as given, before part 1 adds the step
   overhead. The decode steps are priced at their mean batch (the clocks keep totals): exact for a cost
   linear in the batch, and above the truth for a mix of batch sizes where the cost bends (with
   ``plain`` products, batch 3 measured dearer than 4), so a contention fitted from it errs low.
   On a 2-core host nearly all of the sharing is the wait for a core (docs/benchmarks.md, "The
   simulator against real runs").

The calibration's loads are its own; never the load the simulator is later checked against.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import threading
import time
from collections.abc import Callable

import httpx

from planner.profile import DecodeCost, PrefillCost, Profile
from planner.results import SimResult
from planner.simulator import Cluster, RequestSpec, simulate

MIN_STRETCH = 1.05  # a measured ratio (wall / CPU, CPU / priced) below this models nothing
CALIBRATION_SEED = 19_041  # the host load's prompts: never the seed of a load it is checked against
TOKEN_RANGE = (1000, 8000)  # the host load's prompt token ids (plain words in the default vocabulary)
HOST_CORES_RANGE = (0.05, 64.0)  # where fit_host_share searches host_cores
CONTENTION_RANGE = (1.0, 16.0)  # and the contentions
FIT_ROUNDS = 3  # fit_host_share's rounds of refitting each figure with the others'

WORDS = ("apple", "river", "stone", "cloud", "paper", "glass", "music", "tiger", "light", "sugar", "ocean",
         "maple", "bread", "silver", "forest", "candle")


@dataclasses.dataclass(frozen=True)
class HostLoad:
    """The load under which the host's stretch is measured (``pdserve profile --calibrate-*``)."""

    concurrency: int = 4
    input_len: int = 256
    output_len: int = 32
    duration_s: float = 20.0
    seed: int = CALIBRATION_SEED


@dataclasses.dataclass(frozen=True)
class StepClocks:
    """Step clocks and step work (``engine/step_work.py``) summed over a role's workers between two reads
    of ``/v1/workers``: all steps' count, wall and stepping-thread CPU seconds; the decode-only steps'
    count, wall seconds, rows and context tokens; the prompt-carrying steps' count, wall seconds, prompt
    tokens and attended pairs."""

    steps: int
    wall_s: float
    cpu_s: float
    decode_steps: int = 0
    decode_wall_s: float = 0.0
    decode_rows: int = 0
    decode_context: int = 0
    prefill_steps: int = 0
    prefill_wall_s: float = 0.0
    prefill_tokens: int = 0
    prefill_attended: float = 0.0

    @property
    def cpu_stretch(self) -> float:
        """Wall over stepping-thread CPU: the part of the stretch that is waiting for a core."""
        return self.wall_s / self.cpu_s if self.cpu_s > 0 else 1.0

    def decode_priced_s(self, cost: DecodeCost) -> float:
        """What the profile prices the decode-only steps at (one worker alone): each at the steps' mean
        batch (the clocks keep totals, not each step's batch; exact for a cost linear in the batch)."""
        if not self.decode_steps:
            return 0.0
        return (cost.batch_s(self.decode_rows / self.decode_steps) * self.decode_steps
                + cost.per_context_s * self.decode_context)

    def prefill_priced_s(self, cost: PrefillCost) -> float:
        """What the profile prices the prompt-carrying steps at (one worker alone)."""
        return (cost.base_s * self.prefill_steps + cost.per_token_s * self.prefill_tokens
                + cost.per_attended_s * self.prefill_attended)

    def decode_stretch(self, cost: DecodeCost) -> float:
        """Decode-only steps' wall seconds over their priced seconds (1 when none ran)."""
        priced = self.decode_priced_s(cost)
        return self.decode_wall_s / priced if self.decode_steps and priced > 0 else 1.0

    def prefill_stretch(self, cost: PrefillCost) -> float:
        """Prompt-carrying steps' wall seconds over their priced seconds (1 when none ran)."""
        priced = self.prefill_priced_s(cost)
        return self.prefill_wall_s / priced if self.prefill_steps and priced > 0 else 1.0


# StepClocks' fields: the names of each worker's ``clock`` in /v1/workers (messages.wire.StepStats)
CLOCK_FIELDS = tuple(f.name for f in dataclasses.fields(StepClocks))


def _one(client: httpx.Client, url: str, model: str, prompt: str | list[int], max_tokens: int,
         stamps: list[float] | None = None) -> tuple[float, list[float], int]:
    """(TTFT, gaps between text chunks, prompt tokens) of one streamed completion; ``stamps`` collects
    the ``time.perf_counter()`` of every text chunk as it arrives."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: float | None = None
    gaps: list[float] = []
    last, prompt_tokens = start, 0
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"--calibrate: {url} answered {resp.status_code}: {resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:])
            if obj.get("usage"):
                prompt_tokens = int(obj["usage"].get("prompt_tokens") or 0)
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                now = time.perf_counter()
                if stamps is not None:
                    stamps.append(now)
                if ttft is None:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
    if ttft is None:
        raise RuntimeError(f"--calibrate: {url} streamed no text")
    return ttft, gaps, prompt_tokens


def calibrate(profile: Profile, url: str, *, requests: int = 10, max_tokens: int = 16,
              load: HostLoad = HostLoad(), api_key: str | None = None, timeout: float = 120.0,
              progress: Callable[[str], None] = lambda m: None) -> Profile:
    """``profile`` with the request overhead, the decode step base and ``host_cores`` measured on
    ``url`` (see the module docstring)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = url.rstrip("/")
    samples: list[tuple[float, list[float], int]] = []
    with httpx.Client(timeout=timeout, headers=headers) as client:
        model = client.get(f"{url}/v1/models").raise_for_status().json()["data"][0]["id"]
        _one(client, url, model, "warm up " * 8, 2)
        progress(f"calibrate: {requests} requests one at a time")
        for i in range(requests):
            prompt = f"{WORDS[i % len(WORDS)]} {i} " + "the quick brown fox jumps over the lazy dog " * 3
            samples.append(_one(client, url, model, prompt, max_tokens))
        where = f"{url} ({requests} requests one at a time)"
        calibrated = apply_calibration(profile, samples, max_tokens, where)
        progress(f"calibrate: {load.concurrency} clients for {load.duration_s:g} s, {load.input_len}-token "
                 f"prompts, {load.output_len} tokens out")
        before = _worker_stats(client, url)
        lengths = _host_load(client, url, model, load, timeout)
        after = _worker_stats(client, url)
    clocks = {role: role_clocks(before, after, role) for role in ("prefill", "decode")}
    cluster = Cluster(_count(after, "prefill"), _count(after, "decode"))
    return apply_host_load(calibrated, cluster, load, lengths, clocks["prefill"], clocks["decode"],
                           engine=profile)


def _worker_stats(client: httpx.Client, url: str) -> list[dict[str, object]]:
    workers = client.get(f"{url}/v1/workers").raise_for_status().json()["workers"]
    assert isinstance(workers, list)
    return workers


def _count(stats: list[dict[str, object]], role: str) -> int:
    n = sum(1 for w in stats if w.get("role") == role)
    if n == 0:
        raise RuntimeError(f"--calibrate: the server lists no {role} worker in /v1/workers (the host load "
                           f"is simulated disaggregated)")
    return n


def role_clocks(before: list[dict[str, object]], after: list[dict[str, object]], role: str) -> StepClocks:
    """A role's step clocks between the two reads (a worker that restarted between them is left out)."""
    old = {w["worker_id"]: w for w in before}
    sums = dict.fromkeys(CLOCK_FIELDS, 0.0)
    for w in after:
        b = old.get(w["worker_id"])
        if w.get("role") != role or b is None:
            continue
        now, then = _clock(w), _clock(b)
        d = {name: float(now.get(name, 0)) - float(then.get(name, 0)) for name in CLOCK_FIELDS}
        if min(d.values()) < 0:
            continue
        for name, value in d.items():
            sums[name] += value
    ints = {f.name for f in dataclasses.fields(StepClocks) if f.type in ("int", int)}
    return StepClocks(**{k: round(v) if k in ints else v for k, v in sums.items()})  # type: ignore[arg-type]


def _clock(worker: dict[str, object]) -> dict[str, float]:
    clock = worker.get("clock")
    return clock if isinstance(clock, dict) else {}


def _host_load(client: httpx.Client, url: str, model: str, load: HostLoad,
               timeout: float) -> list[tuple[int, int]]:
    """Run the closed-loop load; (prompt tokens, output tokens) of every request, in the order sent."""
    rng = random.Random(load.seed)
    lock = threading.Lock()
    sent: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    stop_at = time.perf_counter() + load.duration_s

    def client_loop() -> None:
        while time.perf_counter() < stop_at and not errors:
            with lock:
                prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(load.input_len)]
                index = len(sent)
                sent.append((load.input_len, load.output_len))
            try:
                _, _, n = _one(client, url, model, prompt, load.output_len)
            except BaseException as exc:  # noqa: BLE001 - reported after the load ends
                errors.append(exc)
                return
            with lock:
                sent[index] = (n or load.input_len, load.output_len)

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(load.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(load.duration_s + timeout)
    if errors:
        raise RuntimeError(f"--calibrate: a request of the host load failed: {errors[0]}")
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"--calibrate: the host load did not end within {load.duration_s + timeout:g} s")
    return sent


def _solve(simulated: Callable[[float], float], target: float, lo: float, hi: float,
           iterations: int) -> float:
    """The ``x`` in ``[lo, hi]`` at which ``simulated`` (monotone, rising or falling) equals ``target``:
    bisected in log space, clamped to the range's ends."""
    f_lo, f_hi = simulated(lo), simulated(hi)
    rising = f_hi >= f_lo
    if (target <= f_lo) if rising else (target >= f_lo):
        return lo
    if (target >= f_hi) if rising else (target <= f_hi):
        return hi
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        if (simulated(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


@dataclasses.dataclass(frozen=True)
class HostShare:
    """The simulator's host model (``planner/simulator.py``): ``host_cores`` (None: no wait for a core)
    and each role's contention."""

    host_cores: float | None = None
    decode_contention: float = 1.0
    prefill_contention: float = 1.0

    def simulate(self, profile: Profile, cluster: Cluster, load: HostLoad,
                 lengths: list[tuple[int, int]]) -> SimResult:
        """Simulate the host load (closed loop, ``load.concurrency`` clients for ``load.duration_s``,
        requests of ``lengths``) on this host."""
        return simulate(profile, cluster, [RequestSpec(n_in, n_out) for n_in, n_out in lengths],
                        concurrency=load.concurrency, duration_s=load.duration_s, host_cores=self.host_cores,
                        decode_contention=self.decode_contention, prefill_contention=self.prefill_contention)


def fit_host_share(profile: Profile, cluster: Cluster, load: HostLoad, lengths: list[tuple[int, int]], *,
                   wait: float, decode_cpu: float, prefill_cpu: float, rounds: int = FIT_ROUNDS,
                   iterations: int = 40) -> HostShare:
    """The host model at which simulating the host load reproduces what was measured under it: ``wait``
    (stepping wall over CPU time, both roles pooled) by ``host_cores``, and each role's steps' CPU time
    over their price by its contention. A figure under ``MIN_STRETCH`` models nothing (None, 1.0). Each
    figure moves how long the steps overlap, so all three are refitted with the others' latest,
    ``rounds`` times."""
    def fit(share: HostShare, name: str, measured: str, target: float,
            bounds: tuple[float, float]) -> HostShare:
        """``share`` with ``name`` set where the simulated ``measured`` figure equals ``target``."""
        def simulated(x: float) -> float:
            result = dataclasses.replace(share, **{name: x}).simulate(profile, cluster, load, lengths)
            return float(getattr(result, measured))
        return dataclasses.replace(share, **{name: _solve(simulated, target, *bounds, iterations)})

    share = HostShare(None, max(1.0, decode_cpu), max(1.0, prefill_cpu))
    for _ in range(rounds):
        if wait >= MIN_STRETCH:
            share = fit(share, "host_cores", "wait_stretch", wait, HOST_CORES_RANGE)
        for role, target in (("decode", decode_cpu), ("prefill", prefill_cpu)):
            if target >= MIN_STRETCH:
                share = fit(share, f"{role}_contention", f"{role}_cpu_stretch", target, CONTENTION_RANGE)
            else:
                share = dataclasses.replace(share, **{f"{role}_contention": 1.0})
    return share


def apply_host_load(profile: Profile, cluster: Cluster, load: HostLoad, lengths: list[tuple[int, int]],
                    prefill: StepClocks, decode: StepClocks, engine: Profile | None = None) -> Profile:
    """``profile`` with the host model fitted to what the workers' step clocks measured under the host
    load (``fit_host_share``: wall over CPU of both roles' steps; the decode workers' decode-only steps'
    and the prefill workers' prompt-carrying steps' CPU time over what ``engine``'s costs price them at,
    default ``profile``'s), and the figures in its notes."""
    engine = profile if engine is None else engine
    decode_stretch = decode.decode_stretch(engine.decode)
    prefill_stretch = prefill.prefill_stretch(engine.prefill)
    cpu = decode.cpu_s + prefill.cpu_s
    wait = (decode.wall_s + prefill.wall_s) / cpu if cpu > 0 else 1.0
    share = fit_host_share(profile, cluster, load, lengths, wait=wait,
                           decode_cpu=decode_stretch / decode.cpu_stretch,
                           prefill_cpu=prefill_stretch / prefill.cpu_stretch)
    if share == HostShare():
        fitted = "no host sharing modelled"
    else:
        sim = share.simulate(profile, cluster, load, lengths)
        cores = "none" if share.host_cores is None else f"{share.host_cores:.2f}"
        fitted = (f"host_cores {cores}, contention decode {share.decode_contention:.2f}, prefill "
                  f"{share.prefill_contention:.2f} (simulated: wall / CPU {sim.wait_stretch:.2f}, CPU / "
                  f"priced decode {sim.decode_cpu_stretch:.2f}, prefill {sim.prefill_cpu_stretch:.2f}; "
                  f"stretch decode {sim.decode_stretch:.2f}, prefill {sim.prefill_stretch:.2f})")
    note = (f"; host load on {cluster.num_prefill}P:{cluster.num_decode}D ({load.concurrency} clients, "
            f"{load.duration_s:g} s, {len(lengths)} requests of {load.input_len} -> {load.output_len} "
            f"tokens, seed {load.seed}): steps took wall / priced {decode_stretch:.2f}x on decode "
            f"({decode.decode_steps} steps, {decode.decode_rows} rows; wall / CPU "
            f"{decode.cpu_stretch:.2f}x), "
            f"{prefill_stretch:.2f}x on prefill ({prefill.prefill_steps} steps, {prefill.prefill_tokens} "
            f"tokens; wall / CPU {prefill.cpu_stretch:.2f}x); wall / CPU pooled {wait:.2f}x: {fitted}")
    return dataclasses.replace(profile, host_cores=share.host_cores, prefill_host_cores=None,
                               decode_contention=share.decode_contention,
                               prefill_contention=share.prefill_contention, notes=profile.notes + note)


def apply_calibration(profile: Profile, samples: list[tuple[float, list[float], int]], max_tokens: int,
                      where: str) -> Profile:
    """``profile`` with the overheads of ``samples`` = (TTFT, gaps, prompt tokens) per request, one at
    a time (see the module docstring)."""
    overheads: list[float] = []
    gaps_all: list[float] = []
    contexts: list[int] = []
    for ttft, gaps, n in samples:
        blocks = -(-n // profile.model.block_size)
        nbytes = blocks * profile.model.block_size * profile.model.kv_bytes_per_token
        overheads.append(ttft - profile.prefill.prompt_s(n) - profile.transfer.seconds(nbytes))
        gaps_all.extend(gaps)
        contexts.append(n + max_tokens // 2)
    step = profile.decode.step_s(1, int(statistics.median(contexts)))
    step_overhead = max(0.0, statistics.median(gaps_all) - step if gaps_all else 0.0)
    overhead = max(0.0, statistics.median(overheads))
    decode = profile.decode.plus(step_overhead)
    note = (f"; calibrated on {where}: request overhead {overhead * 1000:.1f} ms, "
            f"decode step +{step_overhead * 1000:.1f} ms")
    return dataclasses.replace(profile, request_overhead_s=overhead, decode=decode,
                               notes=profile.notes + note)
