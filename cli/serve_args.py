"""``pdserve serve``'s flags (``add_serve_args``): engine flags plus the cluster, router and
tracing ones, each value checked by its argparse type so a bad one names its flag. The
``--config`` file and the Ray Serve application's args go through the same parser, and
``cli.serve_config.serve_config_from_args`` turns what it parsed into the one ``ServeConfig``. Every
default is read from ``ServeConfig`` (``cluster.config.SERVE_DEFAULTS``), never repeated here."""

from __future__ import annotations

import argparse
from typing import Any

from cli.argtypes import number, parsed_by, positive
from cli.engine_args import add_engine_args, size
from router.config import KvFailurePolicy
from router.policy import POLICIES as POLICIES_ROUTING
from telemetry.tracing import PROTOCOLS

POLICIES = tuple(p.value for p in KvFailurePolicy)


_positive = positive
_non_negative = number(int, lambda v: v >= 0, ">= 0")
_ratio = number(float, lambda v: 0.0 <= v <= 1.0, "within [0, 1]")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``pdserve serve`` (the engine flags included); defaults are ``ServeConfig``'s."""
    from cluster.config import SERVE_DEFAULTS as d

    g = parser.add_argument_group("server")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file of settings keyed by flag name (e.g. 'num-decode: 2'); flags given on "
                        "the command line override it")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port,
                   help="port to listen on (bound before Ray starts; a taken port exits 2)")
    g.add_argument("--api-key", default=d.router.api_key, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $PDSERVE_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=d.served_model_name, metavar="NAME",
                   help="the model name clients send (default: the model file or folder name)")
    g.add_argument("--max-request-bytes", type=size, default=d.router.max_request_bytes, metavar="SIZE",
                   help="largest request body, e.g. 1M; larger ones get 413")
    g.add_argument("--max-queued-requests", type=_positive(int), default=d.router.max_queued_requests,
                   metavar="N",
                   help="requests waiting for their first token before new ones get 503")
    g.add_argument("--max-queued-tokens", type=_positive(int), default=d.router.max_queued_tokens,
                   metavar="N",
                   help="prompt tokens waiting for their first token before new requests get 503 "
                        "(default: no limit)")
    g.add_argument("--request-timeout", type=_positive(float), default=d.router.request_timeout,
                   metavar="SECONDS",
                   help="abort a request (408) that has not finished after this long")
    g.add_argument("--default-max-tokens", type=_positive(int), default=d.router.default_max_tokens,
                   metavar="N",
                   help="max_tokens when a request gives none (default: up to the context length)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--num-prefill", type=int, default=d.num_prefill, metavar="N",
                   help="prefill workers; 0 runs prompts on the decode workers")
    c.add_argument("--num-decode", type=int, default=d.num_decode,
                   metavar="N", help="decode workers")
    c.add_argument("--address", default=d.address, metavar="ADDR",
                   help="Ray cluster to attach to: 'auto' (the cluster of this node, or the job's under "
                        "ray job submit) or HOST:PORT (default: start a local Ray instance)")
    c.add_argument("--kv-failure-policy", choices=POLICIES, default=d.client.kv_failure_policy.value,
                   help="when a prefill worker or a KV transfer fails: retry on another prefill worker, "
                        "recompute on decode, or fail the request")
    c.add_argument("--routing", choices=POLICIES_ROUTING, default=d.client.routing,
                   help="how workers are chosen: prefix (cached prefix blocks, load, free KV, transfer "
                        "size), round-robin or least-loaded")
    c.add_argument("--disagg-min-tokens", type=_non_negative, default=d.client.disagg_min_tokens, metavar="N",
                   help="prompts whose uncached part is shorter than N tokens prefill on the decode "
                        "worker; 0 always disaggregates when prefill workers exist")
    c.add_argument("--prefill-saturation-tokens", type=_positive(int),
                   default=d.client.prefill_saturation_tokens, metavar="N",
                   help="while every prefill worker has more than N prompt tokens in flight, new "
                        "prompts prefill on the decode worker")
    c.add_argument("--migration-limit", type=_non_negative, default=d.client.migration_limit, metavar="N",
                   help="times a stream moves to another decode worker when its worker dies")
    c.add_argument("--lease-seconds", type=_positive(float), default=d.lease_seconds, metavar="SECONDS",
                   help="how long prefill keeps KV blocks for decode to pull")
    c.add_argument("--share-cores", action=argparse.BooleanOptionalAction, default=d.share_cores,
                   help="workers on one node run their steps on the threads of idle ones too (decode steps "
                        "on idle prefill workers', prompt chunks on idle decode workers' where the "
                        "products are thread-invariant), given back before the lender computes again; a busy "
                        "decode worker yields its threads to a long prompt (512 tokens or more) between "
                        "steps")
    c.add_argument("--worker-cpus", type=_positive(float), default=d.prefill.num_cpus, metavar="N",
                   help="Ray CPUs reserved by each worker; with --device cuda each also reserves one "
                        "GPU")
    c.add_argument("--torch-threads", type=_non_negative, default=d.prefill.torch_threads, metavar="N",
                   help="torch threads in each worker; 0: one per whole CPU of --worker-cpus, at least one")
    c.add_argument("--prefill-resources", type=_resources("--prefill-resources"), default=d.prefill.resources,
                   metavar="NAME=N[,...]",
                   help="Ray custom resources each prefill worker needs, e.g. prefill_node=1: prefill runs "
                        "only on nodes started with them")
    c.add_argument("--decode-resources", type=_resources("--decode-resources"), default=d.decode.resources,
                   metavar="NAME=N[,...]",
                   help="Ray custom resources each decode worker needs, e.g. decode_node=1")
    c.add_argument("--prefill-labels", type=_labels("--prefill-labels"), default=d.prefill.labels,
                   metavar="KEY=VALUE[,...]",
                   help="Ray node labels prefill workers must run on (ray start --labels), e.g. "
                        "pdserve-role=prefill")
    c.add_argument("--decode-labels", type=_labels("--decode-labels"), default=d.decode.labels,
                   metavar="KEY=VALUE[,...]",
                   help="Ray node labels decode workers must run on, e.g. pdserve-role=decode")
    c.add_argument("--prefill-tp", type=_positive(int), default=d.prefill.tp, metavar="N",
                   help="devices per prefill worker (tensor parallelism): rank 0 is the worker's Ray "
                        "actor, ranks 1..N-1 its processes, each with its KV heads and NIXL agent; decode "
                        "ranks read their heads from the prefill ranks holding them, so the two roles' "
                        "sizes may differ; when not given, --tensor-parallel-size")
    c.add_argument("--decode-tp", type=_positive(int), default=d.decode.tp, metavar="N",
                   help="devices per decode worker (tensor parallelism), as --prefill-tp; when not "
                        "given, --tensor-parallel-size")
    c.add_argument("--max-restarts", type=_non_negative, default=d.prefill.max_restarts, metavar="N",
                   help="times Ray restarts a worker whose process died; it then rejoins")
    c.add_argument("--placement-timeout", type=_positive(float), default=d.prefill.placement_timeout,
                   metavar="SECONDS",
                   help="fail when a worker's resources cannot be reserved within this long")
    c.add_argument("--inject-transfer-failures", type=_ratio, default=d.inject_transfer_failures,
                   metavar="RATE",
                   help="FOR TESTING ONLY: the decode workers fail this fraction of KV pulls on purpose "
                        "(seeded by --seed and the worker id; the client retries per --kv-failure-policy), "
                        "as chaos runs do; 0 means off")
    t = parser.add_argument_group("telemetry")
    t.add_argument("--otlp-traces-endpoint", default=d.tracing.endpoint, metavar="URL",
                   help="send OpenTelemetry traces over OTLP here, e.g. http://127.0.0.1:4318/v1/traces "
                        "(http/protobuf) or 127.0.0.1:4317 (grpc) "
                        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                        "else $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)")
    t.add_argument("--otlp-traces-protocol", choices=PROTOCOLS, default=d.tracing.protocol,
                   help="OTLP transport (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else http/protobuf)")
    t.add_argument("--otlp-traces-sample-ratio", type=_ratio, default=d.tracing.sample_ratio, metavar="RATIO",
                   help="fraction of requests traced, 0..1 (default: $OTEL_TRACES_SAMPLER_ARG, else 1.0)")
    _add_planner_args(parser)
    add_engine_args(parser)


def _add_planner_args(parser: argparse.ArgumentParser) -> None:
    from cluster.config import SERVE_DEFAULTS

    d = SERVE_DEFAULTS.planner
    p = parser.add_argument_group("planner")
    p.add_argument("--planner", action="store_true", default=d.enabled,
                   help="add and drain workers while serving to hold --slo: every --planner-interval the "
                        "live load goes to the simulator with --planner-profile")
    p.add_argument("--planner-profile", default=d.profile, metavar="PATH",
                   help="the profile file the planner's simulator uses (written by `pdserve profile`)")
    for role in ("prefill", "decode"):
        for edge, word in (("min", "fewest"), ("max", "most")):
            p.add_argument(f"--{edge}-{role}", type=_non_negative, default=None, metavar="N",
                           help=f"the {word} {role} workers the planner keeps (default: --num-{role})")
    p.add_argument("--slo", type=_slo, default=d.slo, metavar="ttft=S,itl=S",
                   help="the planner's target: p90 time to first token and p90 inter-token latency, in "
                        "seconds or with an ms suffix; when not given, ttft=1,itl=0.05")
    p.add_argument("--planner-interval", type=_positive(float), default=d.interval, metavar="SECONDS",
                   help="seconds between two planner decisions")
    p.add_argument("--planner-hysteresis", type=_positive(int), default=d.hysteresis, metavar="N",
                   help="intervals in a row a new worker count must be called for before the planner "
                        "acts")
    p.add_argument("--planner-drain-deadline", type=_positive(float), default=d.drain_deadline,
                   metavar="SECONDS",
                   help="how long a worker the planner removes may take to finish its requests; past it "
                        "they move to other workers")


def _slo(text: str) -> Any:
    from cluster.config import parse_slo

    return parsed_by(parse_slo, "--slo")(text)


def _resources(flag: str) -> Any:
    from cluster.placement import parse_resources

    return parsed_by(parse_resources, flag)


def _labels(flag: str) -> Any:
    from cluster.placement import parse_labels

    return parsed_by(parse_labels, flag)


