#!/usr/bin/env bash
# A local trace UI and metrics store for a running pdserve, without Docker:
#   Arize Phoenix (OTLP trace UI, installed once into its own venv, not a pdserve dependency)
#     UI and OTLP/HTTP on http://127.0.0.1:6006 (traces: http://127.0.0.1:6006/v1/traces), OTLP/gRPC 127.0.0.1:4317
#   Prometheus (Debian package `prometheus`, apt-get installed when missing) on http://127.0.0.1:9090,
#     scraping PDSERVE (default 127.0.0.1:8000) every 2 s.
# Usage: bash scripts/observe.sh [HOST:PORT]; then, in another shell:
#   pdserve serve --otlp-traces-endpoint http://127.0.0.1:6006/v1/traces
# Ctrl-C stops both. Ports: PHOENIX_PORT (6006), PHOENIX_GRPC_PORT (4317), PROMETHEUS_PORT (9090).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target="${1:-127.0.0.1:8000}"
cache="${PDSERVE_CACHE:-$HOME/.cache/pdserve}"
venv="$cache/phoenix-venv"
state="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-observe.XXXXXX")"
phoenix_port="${PHOENIX_PORT:-6006}"
prom_port="${PROMETHEUS_PORT:-9090}"

if [[ ! -x "$venv/bin/phoenix" ]]; then
    echo "observe.sh: installing Arize Phoenix into $venv (once, ~850 MB)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "arize-phoenix==20.26.1"
fi
bash scripts/ensure_apt.sh prometheus prometheus

sed "s|host.docker.internal:8000|$target|; s|scrape_interval: 5s|scrape_interval: 2s|" \
    deploy/observability/prometheus.yml > "$state/prometheus.yml"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; rm -rf "$state"; }
trap cleanup EXIT INT TERM

prometheus --config.file="$state/prometheus.yml" --storage.tsdb.path="$state/tsdb" \
    --web.listen-address="127.0.0.1:$prom_port" > "$state/prometheus.log" 2>&1 &
pids+=($!)
PHOENIX_HOST=127.0.0.1 PHOENIX_PORT="$phoenix_port" PHOENIX_GRPC_PORT="${PHOENIX_GRPC_PORT:-4317}" \
    PHOENIX_WORKING_DIR="$state/phoenix" PHOENIX_TELEMETRY_ENABLED=false \
    PHOENIX_ALLOW_EXTERNAL_RESOURCES=false \
    "$venv/bin/python" scripts/phoenix_local.py > "$state/phoenix.log" 2>&1 &
pids+=($!)

for _ in $(seq 120); do
    curl -fs "http://127.0.0.1:$phoenix_port/" >/dev/null 2>&1 && break
    sleep 1
done
echo "traces:  http://127.0.0.1:$phoenix_port  (pdserve serve --otlp-traces-endpoint http://127.0.0.1:$phoenix_port/v1/traces)"
echo "metrics: http://127.0.0.1:$prom_port  (scraping http://$target/metrics)"
wait
