#!/usr/bin/env bash
# GPU first light on the device machine (docs/gpu.md): installs the wheels carried in .whl/ (none are
# needed for the first steps; NIXL's and msgspec's for the transfer step), then runs every step of
# bench/lab/first_light.py within one device call. Arguments go to it (--budget-s, --steps, --dry-run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install --no-index --no-deps --quiet .whl/*.whl
fi
exec "$PY" -m bench.lab.first_light --out "${OUT:-first_light_out}" "$@"
