#!/usr/bin/env bash
# Submit a training run to a running Ray cluster with `ray job submit` (the driver runs on the cluster).
#
#   RAY_ADDRESS=http://HEAD:8265 bash launch/submit.sh +recipe=search_r1_ppo model=qwen2_5_3b_instruct \
#       data=nq_hotpotqa retriever=wiki18_e5 rollout=vllm trainer=gpu_1x8 trainer.run_dir=/shared/runs/sr1
#
# Env: RAY_ADDRESS (the head's dashboard address, required), RUNTIME_ENV (default launch/runtime_env.yaml),
# PYTHON / RAY (default: this checkout's .venv/bin/python and .venv/bin/ray; PYTHON also runs the job's driver),
# NO_WAIT=1 to return right after submission, SUBMISSION_ID to name the job, FORWARD_ENV="VAR ..." for more secret
# variables to forward (e.g. a judge key named by reward.judge.api_key_env other than OPENAI_API_KEY).
# The working directory (this checkout's code, minus what runtime_env.yaml excludes: indexes, data, checkpoints,
# caches) is uploaded to the cluster; every node needs the project's dependencies installed (bash launch/install.sh)
# and trainer.run_dir on a filesystem every node shares with POSIX rename (NFS, Lustre; not an s3fs/gcsfuse bucket
# mount) for checkpoints and resume. See docs/cluster.md.
# Ray workers do not inherit this shell's environment: RETRIEVER_TOKEN, SERPER_API_KEY, WANDB_API_KEY and
# OPENAI_API_KEY, when set here, are added to a private copy of the runtime env (mode 600, removed on exit) and so
# reach the driver and every worker. Anyone who can read the job's details on the Ray dashboard can read them too.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the cluster dashboard, e.g. http://127.0.0.1:8265}"
RUNTIME_ENV=${RUNTIME_ENV:-launch/runtime_env.yaml}
# This checkout's venv (bash launch/install.sh), by absolute path: the job's driver runs on the head node with the
# interpreter named here, so the nodes need the project installed at the same path (or set PYTHON / RAY).
PY=${PYTHON:-$PWD/.venv/bin/python}
RAY=${RAY:-$PWD/.venv/bin/ray}
for tool in "$PY" "$RAY"; do
  if ! command -v "$tool" >/dev/null; then
    echo "error: $tool not found: run bash launch/install.sh (it installs into ./.venv), or set PYTHON / RAY" >&2
    exit 2
  fi
done
tmp_dir=$(mktemp -d)
trap 'rm -rf "$tmp_dir"' EXIT
job_env="$tmp_dir/runtime_env.yaml"
# shellcheck disable=SC2086  # FORWARD_ENV is a list of names
"$PY" -m rsearch_verl.secrets "$RUNTIME_ENV" "$job_env" ${FORWARD_ENV:-}
args=(--address "$RAY_ADDRESS" --working-dir . --runtime-env "$job_env")
[ -n "${NO_WAIT:-}" ] && args+=(--no-wait)
[ -n "${SUBMISSION_ID:-}" ] && args+=(--submission-id "$SUBMISSION_ID")
"$RAY" job submit "${args[@]}" -- "$PY" -m rsearch_verl.main "$@"
