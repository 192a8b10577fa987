"""``serve_config_from_args``: the parsed ``pdserve serve`` flags (from the command line, a ``--config``
file or the Ray Serve application's args) as the one frozen ``ServeConfig``. The only place a
``Namespace`` becomes configuration; nothing below ``cli/`` sees argparse."""

from __future__ import annotations

import argparse

from cli.engine_args import engine_config_from_args
from cluster.config import PlannerOptions, ServeConfig, TraceFlags
from cluster.placement import WorkerOptions
from engine.loader import load_model_source, resolve_model
from engine.tensor_parallel import check_tp_size
from router.config import ClientConfig, KvFailurePolicy, RouterSettings


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Build the ``ServeConfig``; raises ValueError naming the flag on a value argparse let through."""
    engine = engine_config_from_args(args)
    gpus = 1 if engine.device.startswith("cuda") else 0

    def workers(role: str) -> WorkerOptions:
        # --prefill-tp / --decode-tp, else (0) --tensor-parallel-size for both roles (cluster/workers.py)
        role_tp = getattr(args, f"{role}_tp")
        tp = role_tp or engine.tensor_parallel_size
        if tp > 1:  # before any worker starts, naming the flag
            flag = f"--{role}-tp" if role_tp else "--tensor-parallel-size"
            try:
                check_tp_size(load_model_source(resolve_model(args.model)).config, tp)
            except ValueError as exc:
                raise ValueError(f"{flag} {tp}: {exc}") from None
        return WorkerOptions(
            num_cpus=args.worker_cpus, num_gpus=gpus, torch_threads=args.torch_threads,
            max_restarts=args.max_restarts, placement_timeout=args.placement_timeout,
            resources=dict(getattr(args, f"{role}_resources")), labels=dict(getattr(args, f"{role}_labels")),
            tp=role_tp, resources_flag=f"--{role}-resources")

    return ServeConfig(
        model=args.model, served_model_name=args.served_model_name,
        host=args.host, port=args.port, address=args.address,
        num_prefill=args.num_prefill, num_decode=args.num_decode, lease_seconds=args.lease_seconds,
        engine=engine,
        router=RouterSettings(
            api_key=args.api_key, max_request_bytes=args.max_request_bytes,
            max_queued_requests=args.max_queued_requests, max_queued_tokens=args.max_queued_tokens,
            request_timeout=args.request_timeout, default_max_tokens=args.default_max_tokens),
        client=ClientConfig(
            kv_failure_policy=KvFailurePolicy(args.kv_failure_policy), routing=args.routing,
            disagg_min_tokens=args.disagg_min_tokens,
            prefill_saturation_tokens=args.prefill_saturation_tokens, migration_limit=args.migration_limit),
        prefill=workers("prefill"), decode=workers("decode"),
        tracing=TraceFlags(endpoint=args.otlp_traces_endpoint, protocol=args.otlp_traces_protocol,
                           sample_ratio=args.otlp_traces_sample_ratio),
        inject_transfer_failures=args.inject_transfer_failures, share_cores=args.share_cores,
        planner=PlannerOptions(
            enabled=args.planner, profile=args.planner_profile, min_prefill=args.min_prefill,
            max_prefill=args.max_prefill, min_decode=args.min_decode, max_decode=args.max_decode,
            slo=args.slo, interval=args.planner_interval, hysteresis=args.planner_hysteresis,
            drain_deadline=args.planner_drain_deadline),
    )
