#!/usr/bin/env bash
# The simulator against real runs on this machine (docs/benchmarks.md, "The simulator against real runs").
#
# 1. `pdserve profile --quick` measures one worker's engine and a NIXL read here;
# 2. for each P:D in $CONFIGS: `pdserve serve` on its own local Ray, `pdserve profile --calibrate` once
#    (first P:D only: the serving stack's fixed costs, one request at a time, and the host model fitted
#    to the workers' step clocks under the calibration's own load and seed: wall over CPU for host_cores,
#    CPU over the profile's price of the same steps for each role's contention), then per workload in
#    $WORKLOADS two real `pdserve bench` runs and `pdserve simulate` of each with the same profile and P:D:
#    - closed loop: --concurrency $CONC for $DURATION s, simulated with the same workload and load;
#    - open loop: Poisson arrivals at the workload's rate in $RATES for $OPEN_DURATION s (seed $OPEN_SEED:
#      other prompts than the closed loop's, so no prefix-cache hit carries over), simulated on the very
#      requests the bench sent (`python -m bench.lab.sim_validation trace`: send times and measured lengths);
# 3. a markdown table of simulated against measured TTFT p50/p90, ITL p50 and throughput.
#
# It starts servers and Ray: run it under the machine's heavy-work lock if it has one. Every output goes
# to $OUT (default bench_out/sim_validation).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-bench_out/sim_validation}
DURATION=${DURATION:-60}
CONC=${CONC:-4}
OPEN_DURATION=${OPEN_DURATION:-90}
OPEN_SEED=${OPEN_SEED:-1}
RATES=${RATES:-"random:0.35 shared-prefix:0.5"}
PORT=${PORT:-8139}
ENGINE_FLAGS=${ENGINE_FLAGS:---linear-kernel plain}
CONFIGS=${CONFIGS:-"1:1 1:2"}
WORKLOADS=${WORKLOADS:-"random:input_len=256,output_len=32 shared-prefix:num_prefixes=4,questions_per_prefix=8,prefix_len=384,question_len=32,output_len=32"}
PDSERVE=("$PY" -m cli.main)

mkdir -p "$OUT"
PROFILE=$OUT/profile.json
echo "load average before profiling: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/loadavg.txt"
# shellcheck disable=SC2086
"${PDSERVE[@]}" profile --quick $ENGINE_FLAGS --output "$PROFILE"

SERVER=""
stop_server() {
    if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
        kill -INT "$SERVER"
        for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
        kill -0 "$SERVER" 2>/dev/null && kill -KILL "$SERVER"
    fi
    SERVER=""
}
trap stop_server EXIT

calibrated=0
for config in $CONFIGS; do
    P=${config%%:*}
    D=${config##*:}
    # shellcheck disable=SC2086
    "${PDSERVE[@]}" serve $ENGINE_FLAGS --num-prefill "$P" --num-decode "$D" --port "$PORT" \
        >"$OUT/serve_${P}p${D}d.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
        kill -0 "$SERVER" 2>/dev/null || { echo "server ${P}P:${D}D died; see $OUT/serve_${P}p${D}d.log"; exit 1; }
        sleep 1
    done
    # warm every worker up (first forwards allocate and initialise kernels) with a few short requests
    model=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
    warm=()
    for i in $(seq $((2 * (P + D)))); do
        curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/completions" -H "Content-Type: application/json" \
            -d "{\"model\": \"$model\", \"prompt\": \"warm up $i the quick brown fox\", \"max_tokens\": 8}" &
        warm+=($!)
    done
    wait "${warm[@]}" || true
    if [ "$calibrated" = 0 ]; then
        "${PDSERVE[@]}" profile --calibrate "http://127.0.0.1:$PORT" --output "$PROFILE" || echo "calibration failed"
        calibrated=1
    fi
    for w in $WORKLOADS; do
        name=${w%%:*}
        params=${w#*:}
        dir=$OUT/${P}p${D}d_${name}
        echo "${P}P:${D}D $name: load average at start $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
        curl -sf "http://127.0.0.1:$PORT/v1/workers" >"$dir.workers_before.json" || true
        "${PDSERVE[@]}" bench --url "http://127.0.0.1:$PORT" --workload "$name" --param "$params" \
            --concurrency "$CONC" --duration "$DURATION" --output "$dir" --no-progress >"$dir.bench.txt" 2>&1 || true
        # the workers' stats after the run (step clocks, prefix hits, queue and transfer times)
        curl -sf "http://127.0.0.1:$PORT/v1/workers" >"$dir.workers_after.json" || true
        "${PDSERVE[@]}" simulate --profile "$PROFILE" --workload "$name" --param "$params" --concurrency "$CONC" \
            --duration "$DURATION" --num-prefill "$P" --num-decode "$D" --host-cores 0 --json "$dir.sim.json" >"$dir.sim.txt"
        "${PDSERVE[@]}" simulate --profile "$PROFILE" --workload "$name" --param "$params" --concurrency "$CONC" \
            --duration "$DURATION" --num-prefill "$P" --num-decode "$D" \
            --json "$dir.sim_host.json" >"$dir.sim_host.txt"
        rate=""
        for r in $RATES; do [ "${r%%:*}" = "$name" ] && rate=${r#*:}; done
        [ -n "$rate" ] || continue
        open=${dir}_open
        echo "${P}P:${D}D $name open loop at $rate/s: load average at start $(cut -d' ' -f1-3 /proc/loadavg)" \
            | tee -a "$OUT/loadavg.txt"
        curl -sf "http://127.0.0.1:$PORT/v1/workers" >"$open.workers_before.json" || true
        "${PDSERVE[@]}" bench --url "http://127.0.0.1:$PORT" --workload "$name" --param "$params" \
            --rate "$rate" --duration "$OPEN_DURATION" --seed "$OPEN_SEED" --output "$open" --no-progress \
            >"$open.bench.txt" 2>&1 || true
        curl -sf "http://127.0.0.1:$PORT/v1/workers" >"$open.workers_after.json" || true
        prefix_len=$(echo "$params" | tr ',' '\n' | sed -n 's/^prefix_len=//p')
        "$PY" -m bench.lab.sim_validation trace "$open" "$open.trace.csv" --prefix-len "${prefix_len:-0}"
        "${PDSERVE[@]}" simulate --profile "$PROFILE" --trace "$open.trace.csv" --num-prefill "$P" \
            --num-decode "$D" --host-cores 0 --json "$open.sim.json" >"$open.sim.txt"
        "${PDSERVE[@]}" simulate --profile "$PROFILE" --trace "$open.trace.csv" --num-prefill "$P" \
            --num-decode "$D" --json "$open.sim_host.json" >"$open.sim_host.txt"
    done
    stop_server
done

"$PY" -m bench.lab.sim_validation table "$OUT" "$CONFIGS" "$WORKLOADS"
