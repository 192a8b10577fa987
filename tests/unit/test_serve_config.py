"""``pdserve serve --config FILE.yaml``, the placement flags, and their errors (no Ray, no model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.config_file import ConfigError, load_config, parse_with_config, subparser
from cli.main import build_parser, main
from cli.serve_config import serve_config_from_args
from cluster.config import describe
from cluster.placement import Placement, parse_labels, parse_resources

CONFIG = """
num-decode: 2
num_prefill: 3
routing: round-robin
prefill-resources: {prefill_node: 1}
decode-resources: "decode_node=1,ssd=0.5"
enable-prefix-caching: false
kv-cache-memory: 64M
api-key: secret
max-restarts: 5
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pdserve.yaml"
    path.write_text(text)
    return str(path)


def test_file_then_flags_override(tmp_path: Path) -> None:
    path = write(tmp_path, CONFIG)
    cfg = serve_config_from_args(parse_with_config(build_parser(), ["serve", "--config", path,
                                                                    "--num-decode", "4"]))
    assert (cfg.num_decode, cfg.num_prefill, cfg.client.routing) == (4, 3, "round-robin")
    assert cfg.prefill.resources == {"prefill_node": 1.0}
    assert cfg.decode.resources == {"decode_node": 1.0, "ssd": 0.5}
    assert cfg.engine.enable_prefix_caching is False and cfg.engine.kv_cache_memory == 64 * 1024**2
    assert cfg.prefill.max_restarts == cfg.decode.max_restarts == 5
    assert cfg.port == 8000  # untouched flags keep their defaults
    shown = describe(cfg)
    assert "  num-decode: 4" in shown and "  api-key: ***" in shown and "secret" not in shown
    assert "  kv-cache-memory: 67108864" in shown and "  prefill-resources: {'prefill_node': 1.0}" in shown


@pytest.mark.parametrize(("text", "needle"), [
    ("num-decoders: 2\n", "unknown key 'num-decoders'"),
    ("port: eighty\n", "key 'port' (--port): invalid int value"),
    ("routing: random\n", "key 'routing' (--routing): 'random' is not one of"),
    ("enable-prefix-caching: maybe\n", "(--enable-prefix-caching) must be true or false"),
    ("prefill-resources: {CPU: 2}\n", "(--prefill-resources): CPU is set by --worker-cpus"),
    ("kv-cache-memory: lots\n", "(--kv-cache-memory): invalid size"),
    ("- a list\n", "must hold a mapping"),
    ("port: [1, 2]\n", "takes one value"),
])
def test_bad_file_names_key_and_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                     needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, subparser(build_parser(), "serve"))
    assert needle in str(err.value)
    assert main(["serve", "--config", path]) == 2
    assert needle in capsys.readouterr().err


def test_missing_and_invalid_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "--config: cannot read" in capsys.readouterr().err
    assert main(["serve", "--config", write(tmp_path, "port: [\n")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err


def test_placement_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_resources("prefill_node=1, gpu.h100 , x=0.25") == {"prefill_node": 1.0, "gpu.h100": 1.0,
                                                                     "x": 0.25}
    for argv, needle in ((["--prefill-resources", "GPU=1"], "argument --prefill-resources"),
                         (["--decode-resources", "a=-1"], "must be > 0"),
                         (["--decode-resources", "9x=1"], "invalid resource name"),
                         (["--prefill-tp", "0"], "argument --prefill-tp"),
                         (["--decode-tp", "2"], "--decode-tp 2: tensor_parallel_size 2 does not divide"),
                         (["--decode-labels", "role"], "expected key=value"),
                         (["--prefill-labels", "role=-bad-"], "argument --prefill-labels: Invalid label"),
                         (["--max-restarts", "-1"], "argument --max-restarts")):
        assert main(["serve", *argv]) == 2
        assert needle in capsys.readouterr().err
    assert parse_labels("pdserve-role=decode, zone=us") == {"pdserve-role": "decode", "zone": "us"}
    assert main(["serve", "--decode-resources", "decode_node=1"]) == 2  # no --address: a local Ray
    assert "--decode-resources selects nodes of a Ray cluster: give its --address" in capsys.readouterr().err
    gpu = Placement(num_cpus=2, num_gpus=1, tp=2, resources={"decode_node": 1})
    assert gpu.bundles() == [{"CPU": 2, "decode_node": 1, "GPU": 2.0}]  # the actor holds every rank's GPU
    assert Placement(num_cpus=0.5).bundles() == [{"CPU": 0.5}]


def test_serve_app_args_same_conversion_as_a_config_file(tmp_path: Path) -> None:
    """The Ray Serve builder's args go through the --config conversion; a ``config`` key reads a file."""
    from cli.serve_app import build_app, serve_options

    cfg = serve_options({"num-decode": 2, "prefill-resources": {"prefill_node": 1},
                         "kv-cache-memory": "64M"})
    assert cfg.num_decode == 2 and cfg.prefill.resources == {"prefill_node": 1.0}
    assert cfg.engine.kv_cache_memory == 64 * 1024**2
    assert cfg.prefill.labels == {} and cfg.client.routing == "prefix"  # defaults as on the command line
    path = write(tmp_path, CONFIG.replace("api-key: secret\n", ""))
    cfg = serve_options({"config": path, "num-decode": 4})
    assert (cfg.num_decode, cfg.num_prefill, cfg.client.routing, cfg.decode.max_restarts) == (
        4, 3, "round-robin", 5)
    app = build_app({"num-decode": 3, "max-queued-requests": 10, "max-num-seqs": 8})
    assert app is not None and serve_options(None).num_decode == 1


@pytest.mark.parametrize(("args", "message"), [
    ({"num-decode": "two"}, "key 'num-decode' (--num-decode): invalid int value: 'two'"),
    ({"num-decode": 0}, "--num-decode must be >= 1"),
    ({"routing": "random"}, "key 'routing' (--routing): 'random' is not one of"),
    ({"prefill-resources": {"prefill_node": "lots"}}, "key 'prefill-resources' (--prefill-resources)"),
    ({"nope": 1}, "unknown key 'nope' (no flag --nope)"),
    ({"port": 8001}, "key 'port' (--port) does not apply under Ray Serve"),
    ({"address": "auto"}, "key 'address' (--address) does not apply under Ray Serve"),
    ({"config": 3}, "key 'config' (--config) must be the path of a YAML file"),
    ({"dtype": "float64"}, "key 'dtype' (--dtype)"),
])
def test_serve_app_bad_args_name_the_key(args: dict[str, object], message: str) -> None:
    from cli.serve_app import WHERE, build_app

    with pytest.raises(ConfigError) as exc:
        build_app(args)
    assert message in str(exc.value) and str(exc.value).startswith(WHERE), exc.value


@pytest.mark.parametrize(("argv", "threads"), [
    ([], 1), (["--worker-cpus", "2"], 2), (["--worker-cpus", "0.5"], 1), (["--worker-cpus", "3.5"], 3),
    (["--worker-cpus", "4", "--torch-threads", "2"], 2)])
def test_torch_threads_follow_the_reserved_cpus(argv: list[str], threads: int) -> None:
    args = build_parser().parse_args(["serve", *argv])
    config = serve_config_from_args(args)
    assert config.prefill.threads == config.decode.threads == threads


def test_torch_threads_flag_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--torch-threads", "-1"]) == 2
    assert "argument --torch-threads" in capsys.readouterr().err


def test_eviction_serves_disaggregated() -> None:
    """H2O reaches both roles (a compressed sequence crosses the handoff:
    tests/integration/test_disagg_compressed.py)."""
    argv = ["serve", "--kv-eviction", "h2o", "--kv-budget", "512"]
    cfg = serve_config_from_args(build_parser().parse_args(argv))
    assert cfg.num_prefill == 1
    assert (cfg.engine.kv_eviction, cfg.engine.kv_budget, cfg.engine.kv_recent_tokens) == ("h2o", 512, 256)
    assert cfg.engine.kv_compression == "h2o,budget=512,recent=256"


def test_a_taken_port_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``pdserve serve`` binds its port first: a port another process listens on ends the command with
    exit 2 naming ``--port``, before the model is read or Ray started (both recorded here, not replaced)."""
    import socket

    import cluster.serve

    reached: list[str] = []

    def recorded(step: str) -> Any:
        real = getattr(cluster.serve, step)

        def call(*args: Any, **kwargs: Any) -> Any:
            reached.append(step)
            return real(*args, **kwargs)
        return call

    for step in ("prepare_service", "_start_ray"):
        monkeypatch.setattr(cluster.serve, step, recorded(step))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"--port {port} (--host 127.0.0.1): Address already in use" in capsys.readouterr().err
    assert reached == []
