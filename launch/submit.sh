#!/usr/bin/env bash
# Submit a training run to a running Ray cluster with `ray job submit` (the driver runs on the cluster).
#
#   RAY_ADDRESS=http://HEAD:8265 bash launch/submit.sh +recipe=search_r1_ppo model=qwen2_5_3b_instruct \
#       data=nq_hotpotqa retriever=wiki18_e5 rollout=vllm trainer=gpu_1x8 trainer.run_dir=/shared/runs/sr1
#
# Env: RAY_ADDRESS (the head's dashboard address, required), RUNTIME_ENV (default launch/runtime_env.yaml),
# NO_WAIT=1 to return right after submission, SUBMISSION_ID to name the job.
# The working directory (this checkout, minus what runtime_env.yaml excludes) is uploaded to the cluster; every
# node needs the project's dependencies installed (bash launch/install.sh) and trainer.run_dir on a shared
# filesystem for checkpoints and resume. See docs/cluster.md.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://127.0.0.1:8265}"
RUNTIME_ENV=${RUNTIME_ENV:-launch/runtime_env.yaml}
PY=${PYTHON:-python}
args=(--address "$RAY_ADDRESS" --working-dir . --runtime-env "$RUNTIME_ENV")
[ -n "${NO_WAIT:-}" ] && args+=(--no-wait)
[ -n "${SUBMISSION_ID:-}" ] && args+=(--submission-id "$SUBMISSION_ID")
RAY=${RAY:-ray}
exec "$RAY" job submit "${args[@]}" -- "$PY" -m rsearch_verl.main "$@"
