"""deploy/: the KubeRay and cluster-launcher YAML parse, carry the required fields, and agree with the code.

Every ``pdserve serve`` command in them parses with the real argparse parser; the
custom resources its ``--prefill-resources`` / ``--decode-resources`` ask for are
offered by a worker group (with a GPU when ``--device cuda``); the router's
Service targets the head pod on ``--port``. The RayService's ``serveConfigV2``
validates against Ray Serve's own schema, its ``import_path`` is the application
builder, and its ``args`` pass the builder's validation (the ``--config`` path).
"""

from __future__ import annotations

import importlib
import json
import shlex
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.config_file import parse_with_config
from cli.main import build_parser
from cli.serve_config import serve_config_from_args
from cluster.config import ServeConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_VERSION = version("ray")


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs), path
    return docs


def kuberay() -> list[dict[str, Any]]:
    return [d for p in sorted((DEPLOY / "kuberay").glob("*.yaml")) for d in documents(p)]


def start_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources is a quoted JSON string, as KubeRay passes it to ``ray start``."""
    raw = params.get("resources")
    return dict(json.loads(json.loads(raw))) if raw else {}


def clusters() -> list[tuple[str, dict[str, Any]]]:
    """(name, RayClusterSpec) of every cluster defined: RayClusters and RayJobs with their own."""
    out = []
    for doc in kuberay():
        if doc["kind"] == "RayCluster":
            out.append((doc["metadata"]["name"], doc["spec"]))
        elif doc["kind"] == "RayJob" and "rayClusterSpec" in doc["spec"]:
            out.append((doc["metadata"]["name"], doc["spec"]["rayClusterSpec"]))
        elif doc["kind"] == "RayService":
            out.append((doc["metadata"]["name"], doc["spec"]["rayClusterConfig"]))
    return out


def assert_workers_fit(args: ServeConfig, spec: dict[str, Any]) -> None:
    """Each role's resources are offered by a worker group (with GPUs for cuda), enough replicas of it."""
    offered = [(start_resources(g["rayStartParams"]), int(g["rayStartParams"]["num-gpus"]))
               for g in spec["workerGroupSpecs"]]
    for wanted in (args.prefill.resources, args.decode.resources):
        hosts = [gpus for res, gpus in offered if all(res.get(k, 0) >= v for k, v in wanted.items())]
        assert hosts, (wanted, offered)
        assert args.engine.device != "cuda" or all(g >= 1 for g in hosts)
    replicas = {g["groupName"]: g["replicas"] for g in spec["workerGroupSpecs"]}
    assert args.num_prefill <= replicas["prefill"] and args.num_decode <= replicas["decode"]


def serve_args(entrypoint: str) -> ServeConfig:
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["pdserve", "serve"], entrypoint
    # raises (UsageError, ValueError) on any flag or value the code lacks
    return serve_config_from_args(build_parser().parse_args(argv[1:]))


def test_every_file_parses_and_has_a_readme() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert {p.parent.name for p in files} == {"deploy", "kuberay", "cluster-launcher", "observability"}
    for path in files:
        documents(path)
    for folder in {p.parent for p in files}:
        readme = (folder / "README.md").read_text()
        assert all(p.name in readme for p in folder.glob("*.yaml")), folder


@pytest.mark.parametrize(("name", "spec"), clusters(), ids=[n for n, _ in clusters()])
def test_ray_cluster_spec(name: str, spec: dict[str, Any]) -> None:
    assert spec["rayVersion"] == RAY_VERSION
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert head["template"]["spec"]["containers"][0]["image"]
    assert start_resources(head["rayStartParams"]) == {"ingress": 1}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for group_name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert start_resources(group["rayStartParams"]) == {f"{group_name}_node": 1}
        container = group["template"]["spec"]["containers"][0]
        gpus = int(group["rayStartParams"]["num-gpus"])
        assert gpus >= 1 and int(container["resources"]["limits"]["nvidia.com/gpu"]) == gpus
        assert container["image"] == head["template"]["spec"]["containers"][0]["image"]


def test_jobs_match_the_code_and_their_cluster() -> None:
    specs = dict(clusters())
    docs = kuberay()
    jobs = [d for d in docs if d["kind"] == "RayJob"]
    assert len(jobs) == 2
    for job in jobs:
        args = serve_args(job["spec"]["entrypoint"])
        if "clusterSelector" in job["spec"]:
            spec = specs[job["spec"]["clusterSelector"]["ray.io/cluster"]]
        else:
            spec = specs[job["metadata"]["name"]]
        assert_workers_fit(args, spec)
        assert args.address == "auto" and args.host == "0.0.0.0"
        entry = json.loads(job["spec"]["entrypointResources"])
        assert entry.items() <= start_resources(spec["headGroupSpec"]["rayStartParams"]).items()


def test_router_service_targets_head_port() -> None:
    docs = kuberay()
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "pdserve-router")
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    selector = service["spec"]["selector"]
    assert selector == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    job = next(d for d in docs if d["kind"] == "RayJob" and "clusterSelector" in d["spec"])
    port = serve_args(job["spec"]["entrypoint"]).port
    assert service["spec"]["ports"][0]["targetPort"] == port
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert port in {p["containerPort"] for p in head["ports"]}


def test_ray_service_matches_the_code() -> None:
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from cli.serve_app import DEPLOYMENT, build_app, serve_options

    (doc,) = [d for d in kuberay() if d["kind"] == "RayService"]
    spec = doc["spec"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    (app,) = config.applications
    module, _, attr = app.import_path.partition(":")
    assert getattr(importlib.import_module(module), attr) is build_app
    assert app.route_prefix == "/"
    args = serve_options(app.args)  # raises ConfigError naming the key on anything the code rejects
    built = build_app(app.args)
    assert isinstance(built, Application)
    # the manifest's per-deployment overrides name the deployment the code binds (else Serve rejects them)
    assert [d.name for d in app.deployments] == [built._bound_deployment.name] == [DEPLOYMENT]
    assert args.engine.device == "cuda" and args.prefill.resources and args.decode.resources
    cluster = spec["rayClusterConfig"]
    assert_workers_fit(args, cluster)
    (deployment,) = app.deployments
    assert deployment.name == DEPLOYMENT and deployment.num_replicas == 1
    head = cluster["headGroupSpec"]
    wanted = deployment.ray_actor_options.resources
    assert wanted.items() <= start_resources(head["rayStartParams"]).items()  # the router on the head
    assert config.proxy_location == "HeadOnly" and config.http_options.host == "0.0.0.0"
    port = config.http_options.port
    assert port in {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert [p["targetPort"] for p in spec["serveService"]["spec"]["ports"]] == [port]
    readme = (DEPLOY / "kuberay" / "README.md").read_text()
    assert spec["serveService"]["metadata"]["name"] in readme and app.import_path in readme


def test_cluster_launcher() -> None:
    (config,) = documents(DEPLOY / "cluster-launcher" / "pdserve-aws.yaml")
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type",
                "head_start_ray_commands", "worker_start_ray_commands", "setup_commands"):
        assert key in config, key
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert types[config["head_node_type"]]["resources"]["ingress"] == 1
    roles = {r for t in types.values() for r in t["resources"] if r.endswith("_node")}
    assert roles == {"prefill_node", "decode_node"}
    workers = [t for t in types.values() if {"prefill_node", "decode_node"} & set(t["resources"])]
    assert len(workers) == 2 and all(t["resources"]["GPU"] >= 1 for t in workers)
    for command in config["head_start_ray_commands"][-1:] + config["worker_start_ray_commands"][-1:]:
        assert "RAY_AUTH_MODE=token" in command
    docker = (DEPLOY / "kuberay" / "Dockerfile").read_text()
    assert f"rayproject/ray:{RAY_VERSION}-" in docker


def test_example_config_file_loads() -> None:
    path = DEPLOY / "pdserve.yaml"
    args = parse_with_config(build_parser(), ["serve", "--config", str(path), "--num-decode", "3"])
    cfg = serve_config_from_args(args)
    assert (cfg.address, cfg.engine.device, cfg.num_prefill, cfg.num_decode) == ("auto", "cuda", 2, 3)
    assert cfg.prefill.resources == {"prefill_node": 1.0} and cfg.decode.resources == {"decode_node": 1.0}
    assert cfg.prefill.num_gpus == cfg.decode.num_gpus == 1
    assert "pdserve.yaml" in (DEPLOY / "README.md").read_text()
