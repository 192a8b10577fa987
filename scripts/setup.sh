#!/usr/bin/env bash
# Create .venv/ at the repository root, install pdserve into it (editable) and
# fetch the default model. Safe to run again. Usage: bash scripts/setup.sh [--test]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

extras=""
for arg in "$@"; do
    case "$arg" in
        --test) extras="[test]" ;;
        -h|--help) echo "usage: bash scripts/setup.sh [--test]"; exit 0 ;;
        *) echo "setup.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

if [[ ! -x .venv/bin/python ]]; then
    if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { echo "setup.sh: Python 3.11 or newer is required ($py is older)" >&2; exit 1; }
    "$py" -m venv .venv
fi

.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".${extras}"
.venv/bin/python scripts/fetch_model.py

# The observability tests scrape a real Prometheus server (Debian package `prometheus`).
if [[ -n "$extras" ]] && ! command -v prometheus >/dev/null 2>&1; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
            || echo "setup.sh: could not install 'prometheus' with apt-get; the metrics scrape test will skip" >&2
    else
        echo "setup.sh: install the 'prometheus' package (apt-get install prometheus) for the metrics test" >&2
    fi
fi
