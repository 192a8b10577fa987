"""Chaos soak: load and every fault at once against a real ``pdserve serve``, then prove nothing was lost
and nothing leaked.

    python -m bench.chaos --duration 120 --seed 0            # starts its own server (2 prefill, 2 decode)
    python -m bench.chaos --url http://127.0.0.1:8000 --api-key KEY --duration 600 --seed 0
    python -m bench.chaos --duration 600 --no-faults         # the same workload, no fault injected

Run (all seeded by ``--seed``): a reference pass sends every greedy request shape once, undisturbed
(``bench.chaos_load``); then ``--concurrency`` clients loop over mixed requests (chat and completions
over shared prefixes, streaming or not, ``n`` 1 or 2, stop strings, greedy and sampled) for
``--duration`` seconds while the fault schedule runs: SIGKILL of a random prefill or decode worker
process every ``--kill-interval`` seconds (pids from ``/v1/workers``; Ray restarts them), client
disconnects on ``--disconnect-share`` of the requests, one burst of ``--burst-factor`` x concurrency
requests at 40% of the run, KV-pull failures at ``--transfer-failures`` (the server's
``--inject-transfer-failures``: set on the server this command starts; a server given by ``--url``
must have been started with it), and at half time one graceful drain of a random worker
(``POST /v1/workers/{id}/drain``) followed by a new worker of its role (``POST /v1/workers``), so the
cluster ends as it began (``--no-drain`` leaves it out).

Then the cluster settles and the checks of ``bench.chaos_checks`` run; every request's outcome is
judged (``bench.chaos_load``). The table goes to stdout (``--json FILE`` writes everything as JSON);
the exit status is 0 when every check passed and no request was a violation.

Against ``--url`` the server should run with enough ``--max-restarts`` for the kills (the started one
has 1000). RSS and kills need the server on this host; the Ray census needs this process attached to
the server's Ray (the started server attaches to a Ray this command starts, so it is checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_checks import (
    Check,
    figure,
    index_agreement,
    ray_census,
    rss_checks,
    rss_table,
    settle,
    workers,
)
from bench.chaos_load import Outcome, Spec, Variant, make_specs, pick_variant, send
from bench.chaos_report import Report, render, summarize
from bench.servers import ROOT, free_port, pdserve_cmd

SERVE_FLAGS = ("--num-prefill", "2", "--num-decode", "2", "--max-restarts", "1000", "--worker-cpus", "0.5",
               "--torch-threads", "1", "--kv-cache-memory", "256M", "--linear-kernel", "plain")
API_KEY = "chaos-key"
RETRY_PAUSE_S = 0.5  # a client's pause after a 503 before its next request


@dataclass
class ChaosConfig:
    duration: float = 120.0
    seed: int = 0
    concurrency: int = 4
    kill_interval: float = 20.0
    disconnect_share: float = 0.2
    burst_factor: int = 10
    transfer_failures: float = 0.05
    faults: bool = True
    drain: bool = True
    drain_deadline: float = 60.0
    join_timeout: float = 900.0
    num_workers: int = 4
    settle_timeout: float = 240.0
    request_timeout: float = 180.0
    rss_factor: float = 1.3
    rss_slack_mb: float = 150.0
    num_specs: int = 24


@dataclass
class FaultLog:
    kills: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)  # the drain and the worker added after it
    pull_failures: dict[str, int] = field(default_factory=dict)  # "worker_id/pid" -> most seen
    leases_expired: dict[str, int] = field(default_factory=dict)  # the same, of prefill leases

    def sample(self, stats: list[dict[str, Any]]) -> None:
        for w in stats:
            key = f"{w['worker_id']}/{w['pid']}"
            failures, expired = int(figure(w, "transfer.failures")), int(figure(w, "leases.expired"))
            self.pull_failures[key] = max(self.pull_failures.get(key, 0), failures)
            self.leases_expired[key] = max(self.leases_expired.get(key, 0), expired)


class Chaos:
    def __init__(self, cfg: ChaosConfig, url: str, client: httpx.AsyncClient, model: str) -> None:
        self.cfg, self.url, self.client, self.model = cfg, url, client, model
        self.specs = make_specs(cfg.seed, cfg.num_specs)
        self.reference: dict[int, str] = {}
        self.outcomes: list[Outcome] = []
        self.faults = FaultLog()
        self.t0 = time.perf_counter()
        self.deadline = 0.0

    async def one(self, rng: random.Random, phase: str) -> None:
        share = self.cfg.disconnect_share if self.cfg.faults else 0.0
        variant = pick_variant(rng, self.specs, share)
        out = await send(self.client, self.url, self.model, variant, phase, self.t0, self.reference)
        self.outcomes.append(out)
        if out.kind == "fault_error" and out.status == 503:  # as a client honouring Retry-After would,
            await asyncio.sleep(RETRY_PAUSE_S)  # if sooner than the 1 s it says: the run is short

    async def each_greedy(self, phase: str) -> None:
        """Every greedy spec once, non-streaming, ``n=1``, ``concurrency`` at a time; in the reference
        phase a spec whose request failed is tried again (twice at most)."""
        gate = asyncio.Semaphore(self.cfg.concurrency)

        async def one(spec: Spec) -> None:
            async with gate:
                for _ in range(3 if phase == "reference" else 1):
                    out = await send(self.client, self.url, self.model, Variant(spec, False, 1), phase,
                                     self.t0, self.reference)
                    self.outcomes.append(out)
                    if out.kind == "ok" and phase == "reference":
                        self.reference[spec.key] = out.texts[0]
                    if out.kind == "ok":
                        return

        await asyncio.gather(*(one(s) for s in self.specs if s.greedy))

    async def load(self) -> None:
        async def loop(i: int) -> None:
            rng = random.Random(f"{self.cfg.seed}:client:{i}")
            while time.perf_counter() < self.deadline:
                await self.one(rng, "load")

        await asyncio.gather(*(loop(i) for i in range(self.cfg.concurrency)))

    async def burst(self) -> None:
        await asyncio.sleep(max(0.0, self.deadline - time.perf_counter() - 0.6 * self.cfg.duration))
        rng = random.Random(f"{self.cfg.seed}:burst")
        n = self.cfg.burst_factor * self.cfg.concurrency
        await asyncio.gather(*(self.one(rng, "burst") for _ in range(n)))

    async def kills(self) -> None:
        """A SIGKILL every ``kill_interval`` from half an interval in, every one inside ``duration`` carried
        out: a listing that cannot answer (a worker restarting, a busy host) is asked again for up to an
        interval, so a slow host delays a kill rather than drops it."""
        rng = random.Random(f"{self.cfg.seed}:kills")
        at = self.cfg.kill_interval / 2
        while at < self.cfg.duration:
            await asyncio.sleep(max(0.0, self.deadline - self.cfg.duration + at - time.perf_counter()))
            give_up = time.perf_counter() + self.cfg.kill_interval
            listed = sorted(await workers(self.client, self.url), key=lambda w: w["worker_id"])
            while not listed and time.perf_counter() < give_up:
                await asyncio.sleep(0.5)
                listed = sorted(await workers(self.client, self.url), key=lambda w: w["worker_id"])
            event: dict[str, Any] = {"t": round(time.perf_counter() - self.t0, 2), "killed": False}
            if listed:
                victim = rng.choice(listed)
                event.update(worker_id=victim["worker_id"], role=victim["role"], pid=victim["pid"],
                             killed=True)
                try:
                    os.kill(int(victim["pid"]), signal.SIGKILL)
                except OSError as exc:  # not on this host, or already gone
                    event.update(killed=False, error=repr(exc))
            else:
                event["error"] = "/v1/workers did not answer for a whole kill interval"
            self.faults.kills.append(event)
            at += self.cfg.kill_interval

    async def drain_and_replace(self) -> None:
        """At half time drain a random worker whose role has another live one, then add one of its role.
        A refusal because the other worker of the role is restarting (409 ``last_worker``) tries the
        other role, then again a second later, for at most 60 s."""
        await asyncio.sleep(max(0.0, self.deadline - time.perf_counter() - 0.5 * self.cfg.duration))
        rng = random.Random(f"{self.cfg.seed}:drain")
        give_up = time.perf_counter() + 60.0
        drained: dict[str, Any] | None = None
        while drained is None and time.perf_counter() < give_up:
            listed = [w for w in sorted(await workers(self.client, self.url), key=lambda w: w["worker_id"])
                      if not w.get("draining")]
            for victim in rng.sample(listed, len(listed)):
                t = time.perf_counter()
                resp = await self._post(f"/v1/workers/{victim['worker_id']}/drain",
                                        {"deadline_s": self.cfg.drain_deadline},
                                        self.cfg.drain_deadline + 60)
                if resp is not None and resp.status_code == 409:
                    continue
                drained = {"t": round(t - self.t0, 2), "change": "drain", "worker_id": victim["worker_id"],
                           "role": victim["role"], "seconds": round(time.perf_counter() - t, 2),
                           **_answer(resp)}
                break
            else:
                await asyncio.sleep(1.0)
        if drained is None:
            self.faults.changes.append({"change": "drain", "status": 409, "error": "every worker refused"})
            return
        self.faults.changes.append(drained)
        t = time.perf_counter()
        resp = await self._post("/v1/workers", {"role": drained["role"]}, self.cfg.join_timeout)
        self.faults.changes.append({"t": round(t - self.t0, 2), "change": "add", "role": drained["role"],
                                    "seconds": round(time.perf_counter() - t, 2), **_answer(resp)})

    async def _post(self, path: str, body: dict[str, Any], timeout: float) -> httpx.Response | None:
        try:
            return await self.client.post(f"{self.url}{path}", json=body, timeout=timeout)
        except httpx.HTTPError:
            return None

    async def sampler(self) -> None:
        while True:
            self.faults.sample(await workers(self.client, self.url))
            await asyncio.sleep(1.0)

    async def run(self, router_pid: int | None) -> Report:
        cfg = self.cfg
        first, _ = await settle(self.client, self.url, cfg.num_workers, cfg.settle_timeout)
        self.faults.sample(first)
        await self.each_greedy("reference")
        warm, _ = await settle(self.client, self.url, cfg.num_workers, cfg.settle_timeout)
        rss_before = rss_table(warm, router_pid)
        self.deadline = time.perf_counter() + cfg.duration
        background = [asyncio.create_task(self.sampler())]
        work = [self.load()] + ([self.burst(), self.kills()] if cfg.faults else [])
        work += [self.drain_and_replace()] if cfg.faults and cfg.drain else []
        await asyncio.gather(*work)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        end, settle_s = await settle(self.client, self.url, cfg.num_workers, cfg.settle_timeout)
        self.faults.sample(end)
        index = await index_agreement(self.client, self.url, 30.0)
        await self.each_greedy("after")  # the settled cluster serves every greedy shape exactly once more
        back = len(end) == cfg.num_workers and settle_s < cfg.settle_timeout
        expired = sum(self.faults.leases_expired.values())
        checks = [Check("workers back, idle, healthy", back,
                        f"{len(end)}/{cfg.num_workers} workers idle after {settle_s:.1f} s"),
                  Check("prefix index agrees", bool(index.get("agrees")),
                        json.dumps(index.get("workers"))[:300]),
                  Check("no prefill lease expired (each released by its request)",
                        expired == 0, f"{expired} leases ended by their deadline"),
                  *self._change_checks(),
                  Check("every greedy spec has a reference",
                        len(self.reference) == sum(s.greedy for s in self.specs),
                        f"{len(self.reference)} references")]
        checks += rss_checks(rss_before, rss_table(end, router_pid), cfg.rss_factor, cfg.rss_slack_mb)
        census = ray_census({int(w["pid"]) for w in end}, cfg.num_workers)
        checks.append(census or Check("ray actors and placement groups", True,
                                      "not checked (this process is not attached to the server's Ray)"))
        return summarize(asdict(cfg), self.outcomes, self.faults.kills, self.faults.pull_failures, end,
                         rss_before, rss_table(end, router_pid), checks, self.faults.changes)

    def _change_checks(self) -> list[Check]:
        if not (self.cfg.faults and self.cfg.drain):
            return []
        drain = next((c for c in self.faults.changes if c["change"] == "drain"), {})
        add = next((c for c in self.faults.changes if c["change"] == "add"), {})
        return [Check("graceful drain finished", drain.get("status") == 200,
                      f"{drain.get('worker_id')}: {drain.get('status')} in {drain.get('seconds')} s, "
                      f"{drain.get('moved')} moved at the deadline"),
                Check("a worker of its role added", add.get("status") == 200,
                      f"{add.get('worker_id')}: {add.get('status')} in {add.get('seconds')} s "
                      f"{add.get('error', '')}".rstrip())]


async def run_chaos(cfg: ChaosConfig, url: str, api_key: str | None, router_pid: int | None = None) -> Report:
    """One chaos run against the server at ``url`` (see the module docstring)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=cfg.request_timeout, limits=limits) as client:
        models = (await client.get(f"{url}/v1/models", timeout=30)).json()
        return await Chaos(cfg, url, client, models["data"][0]["id"]).run(router_pid)


def _answer(resp: httpx.Response | None) -> dict[str, Any]:
    """The parts of an admin answer the report keeps: status, the worker, ``moved``, or the error."""
    if resp is None:
        return {"status": None, "error": "no answer"}
    try:
        body = resp.json()
    except ValueError:
        body = {}
    out: dict[str, Any] = {"status": resp.status_code}
    if resp.status_code == 200:
        out.update({k: body[k] for k in ("worker_id", "moved") if k in body})
    else:
        out["error"] = str(body.get("error", {}).get("message", resp.text))[:200]
    return out


def start_server(cfg: ChaosConfig, extra: list[str], log_path: Path, ready_timeout: float = 300.0) \
        -> tuple[subprocess.Popen[bytes], str]:
    """``pdserve serve`` (2 prefill + 2 decode) on this process's Ray; (process, url) once healthy."""
    import ray

    port = free_port()
    inject = ("--inject-transfer-failures", str(cfg.transfer_failures)) if cfg.faults else ()
    cmd = pdserve_cmd(port, "--api-key", API_KEY, "--address", str(ray.get_runtime_context().gcs_address),
                      *SERVE_FLAGS, *inject, *extra)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"pdserve serve did not become healthy within {ready_timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(30)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="server to test (default: start pdserve serve, 2P + 2D)")
    p.add_argument("--api-key", default=None, help="its API key (with --url)")
    p.add_argument("--router-pid", type=int, default=None, help="the server's pid, for its RSS (with --url)")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load (default: 120)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of workload and faults (default: 0)")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="clients in a closed loop (default: 4)")
    p.add_argument("--kill-interval", type=float, default=d.kill_interval,
                   help="seconds between worker SIGKILLs (default: 20)")
    p.add_argument("--disconnect-share", type=float, default=d.disconnect_share,
                   help="fraction of requests the client abandons (default: 0.2)")
    p.add_argument("--burst-factor", type=int, default=d.burst_factor,
                   help="the burst sends this many x --concurrency requests at once (default: 10)")
    p.add_argument("--transfer-failures", type=float, default=d.transfer_failures,
                   help="KV pull failure rate of the started server (default: 0.05)")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="the same workload with no kill, disconnect, burst or transfer failure")
    p.add_argument("--no-drain", dest="drain", action="store_false",
                   help="leave the graceful drain (and the worker added after it) out of the schedule")
    p.add_argument("--num-workers", type=int, default=d.num_workers,
                   help="workers the server runs (with --url; default: 4)")
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout,
                   help="seconds the cluster gets to come back after the load (default: 240)")
    p.add_argument("--serve-args", default="", help="extra flags for the started server, one string")
    p.add_argument("--json", type=Path, default=None, help="write the whole report as JSON here")
    args = p.parse_args(argv)
    for name in ("duration", "kill_interval", "settle_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.disconnect_share <= 1 or not 0 <= args.transfer_failures <= 1:
        p.error("--disconnect-share and --transfer-failures must be within [0, 1]")
    if args.concurrency < 1 or args.burst_factor < 0:
        p.error("--concurrency must be >= 1 and --burst-factor >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = ChaosConfig(duration=args.duration, seed=args.seed, concurrency=args.concurrency,
                      kill_interval=args.kill_interval, disconnect_share=args.disconnect_share,
                      burst_factor=args.burst_factor, transfer_failures=args.transfer_failures,
                      faults=args.faults, drain=args.drain, num_workers=args.num_workers,
                      settle_timeout=args.settle_timeout)
    if args.url:
        report = asyncio.run(run_chaos(cfg, args.url.rstrip("/"), args.api_key, args.router_pid))
    else:
        import tempfile

        import ray

        ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
        log_path = Path(tempfile.mkdtemp(prefix="pdserve-chaos-")) / "serve.log"
        proc = None
        try:
            proc, url = start_server(cfg, shlex.split(args.serve_args), log_path)
            print(f"server {url} (log {log_path})", file=sys.stderr)
            report = asyncio.run(run_chaos(cfg, url, API_KEY, proc.pid))
        finally:
            if proc is not None:
                stop_server(proc)
            ray.shutdown()
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1, default=str))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
