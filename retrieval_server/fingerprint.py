"""The index fingerprint: one short string that changes whenever the index would answer a query differently.

    fp = index_fingerprint("indexes/wiki_e5_flat", manifest)   # "sha256:3f1c..." (32 hex digits)

It hashes the passages exactly as served (the corpus store's files, `corpus/`) and the manifest's build metadata
(encoder, pooling, max length, index type and parameters, size, dimension and any key a later build option adds),
leaving out what differs between two builds of the same index: the build's duration and the encoder's path on the
build machine. The vectors themselves are not read (tens of GB for Wikipedia): the encoder and the passages determine
them. `python -m retrieval_server build` writes it into manifest.json (`fingerprint`); an index built before that gets
it computed when it is loaded (one pass over the corpus). GET /health reports it; a record / replay store of search
results is pinned to it (rsearch_verl/search/store.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from retrieval_server.corpus import CONTENTS, OFFSETS

CORPUS_DIR = "corpus"  # retrieval_server/retriever.py's (not imported: retriever imports this module)
VOLATILE_KEYS = ("build_s", "model_path", "fingerprint")
_BLOCK = 8 << 20


def index_fingerprint(index_dir: str, manifest: dict) -> str:
    """`sha256:` + 32 hex digits over the build metadata of `manifest` and the corpus store of `index_dir`."""
    digest = hashlib.sha256()
    meta = {k: v for k, v in manifest.items() if k not in VOLATILE_KEYS}
    digest.update(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    for name in (OFFSETS, CONTENTS):
        digest.update(f"\0{name}\0".encode())
        with open(Path(index_dir) / CORPUS_DIR / name, "rb") as f:
            while block := f.read(_BLOCK):
                digest.update(block)
    return f"sha256:{digest.hexdigest()[:32]}"
