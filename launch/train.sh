#!/usr/bin/env bash
# Train on this machine (starts a local Ray cluster if RAY_ADDRESS is unset). Arguments are Hydra overrides:
#   bash launch/train.sh +recipe=search_r1_grpo trainer.total_steps=50 trainer.run_dir=outputs/grpo
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m rsearch_verl.main "$@"
