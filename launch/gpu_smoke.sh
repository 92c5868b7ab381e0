#!/usr/bin/env bash
# GPU smoke test (at most ~10 minutes on one GPU): CUDA / vLLM / faiss / flash-attn environment, a bf16 actor update
# that changes the fp32 master weights, two PPO steps end to end under 90 % GPU memory with a weight sync whose
# log-prob gap is < 0.02, chunked log-prob memory, faiss-gpu recall equal to the CPU's. Run it on a GPU node after
# `bash launch/install.sh gpu`; the checks and their numbers: launch/gpu_smoke.py, docs/gpu.md.
#   bash launch/gpu_smoke.sh
#   bash launch/gpu_smoke.sh --allow-missing vllm,faiss_gpu,flash_attn --big --json smoke.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
command -v nvidia-smi >/dev/null || { echo "gpu_smoke: nvidia-smi not found: this is not a GPU machine" >&2; exit 2; }
export TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec timeout 900 "$PY" launch/gpu_smoke.py "$@"
