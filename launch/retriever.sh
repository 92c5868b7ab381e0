#!/usr/bin/env bash
# Build the retrieval index if it is missing, then serve it (see docs/retriever.md).
#
#   bash launch/retriever.sh                                   # toy defaults: MiniLM + flat over $CORPUS
#   REPLICAS=2 bash launch/retriever.sh                        # the same through Ray Serve, 2 replicas
#   # the real Wikipedia setup (wiki-18, 21M passages, e5-base-v2; see docs/retriever.md for which index fits where):
#   CORPUS=/data/wiki-18.jsonl ENCODER=e5 INDEX_TYPE=ivfpq_rerank INDEX_DIR=/data/indexes/wiki18_e5_ivfpq_rerank \
#     DEVICE=cuda BUILD_ARGS="--batch-size 512 --encoder-path /models/e5-base-v2" PORT=8000 bash launch/retriever.sh
#
# Environment (all optional):
#   CORPUS      JSONL corpus, one {"id", "contents"} per line (required only when the index must be built)
#   ENCODER     e5 | bge | minilm | bm25 | /path/to/hf/model        (default minilm)
#   INDEX_TYPE  flat | sq8 | hnsw | hnsw_sq8 | ivfpq | ivfpq_rerank   (default flat; ignored for bm25)
#               wiki-18 x e5-base (21M x 768) in RAM: flat ~65 GB, sq8 ~16 GB, hnsw ~70 GB, hnsw_sq8 ~22 GB,
#               ivfpq / ivfpq_rerank ~2.2 GB (ivfpq_rerank adds a 32 GB fp16 file read through mmap)
#   INDEX_DIR   where the index lives; complete once it holds manifest.json   (default indexes/<encoder>_<type>)
#   HOST PORT   bind address and port                                (default 127.0.0.1 8000)
#   DEVICE      cpu | cuda (cuda: fp16 encoder, FAISS sharded over all visible GPUs)   (default cpu)
#   RETRIEVER_TOKEN  bearer token required on /retrieve (read by the server itself)
#   REPLICAS    serve through Ray Serve with N replicas spread over the Ray cluster at $RAY_ADDRESS (unset: a local
#               Ray), an ingress on every node at HOST:PORT; unset or 0: one process (default). See docs/retriever.md
#   REPLICA_CPUS  CPUs per Serve replica; its threads are sized to them            (default 1)
#   INGRESS     auto | haproxy | proxy: Serve's HAProxy ingress or its Python proxy (auto: HAProxy on Linux)
#   BUILD_ARGS / SERVE_ARGS  extra flags for `build` / `serve`, e.g. SERVE_ARGS="--max-topk 50 --workers 1"
#   PYTHON      interpreter (default .venv/bin/python)
set -euo pipefail
if (($#)); then  # e.g. a `serve` copied from `python -m retrieval_server serve`: nothing here reads arguments
  echo "error: launch/retriever.sh takes no arguments (got: $*); it is configured by environment variables," \
    "e.g. INDEX_DIR=indexes/toy CORPUS=corpus.jsonl bash launch/retriever.sh (see the top of this script)" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ENCODER=${ENCODER:-minilm}
INDEX_TYPE=${INDEX_TYPE:-flat}
INDEX_DIR=${INDEX_DIR:-indexes/$(basename "$ENCODER")_${INDEX_TYPE}}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cpu}

if [[ ! -f "$INDEX_DIR/manifest.json" ]]; then
  if [[ -z "${CORPUS:-}" || ! -f "$CORPUS" ]]; then
    echo "error: no index at $INDEX_DIR (no manifest.json) and CORPUS='${CORPUS:-}' is not a file" >&2
    exit 2
  fi
  # Restartable: a build interrupted half-way reuses its finished chunks when run again.
  # shellcheck disable=SC2086
  "$PY" -m retrieval_server build --corpus "$CORPUS" --encoder "$ENCODER" --index-type "$INDEX_TYPE" \
    --out "$INDEX_DIR" --device "$DEVICE" ${BUILD_ARGS:-}
fi

# shellcheck disable=SC2086
exec "$PY" -m retrieval_server serve --index "$INDEX_DIR" --host "$HOST" --port "$PORT" --device "$DEVICE" \
  --replicas "${REPLICAS:-0}" --replica-cpus "${REPLICA_CPUS:-1}" --ingress "${INGRESS:-auto}" ${SERVE_ARGS:-}
