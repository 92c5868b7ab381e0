"""launch/runtime_env.yaml ships code only: indexes, datasets, checkpoints, weights and caches stay behind (Ray refuses
a working directory over its upload limit), while the code under rsearch_verl/data/ and the configs under
recipes/data/ travel. Checked by packing with Ray's own zip routine, the one `ray job submit --working-dir` uses
(`ray._private.runtime_env.packaging._zip_files`, private: Ray has no public helper for its exclude matching).
Also: launch/submit.sh's private copy of the runtime env carries the secrets set in the submitting shell.
Run: .venv/bin/python -m pytest -q tests/trainer/test_runtime_env.py
"""

import os
import stat
import subprocess
import zipfile
from pathlib import Path

import yaml

from rsearch_verl.secrets import write_runtime_env

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_ENV = ROOT / "launch" / "runtime_env.yaml"

CODE = [
    "rsearch_verl/__init__.py",
    "rsearch_verl/data/parquet_data.py",
    "rsearch_verl/trainer/checkpoint.py",
    "recipes/data/toy_world.yaml",
    "launch/runtime_env.yaml",
    "retrieval_server/app.py",
]
BULK = [
    "indexes/wiki18_e5/index.faiss",
    "indexes/wiki18_e5/manifest.json",
    "data/nq/train.parquet",
    "data/wiki18.jsonl",
    "outputs/run/checkpoints/step_000002/actor/dcp/__0_0.distcp",
    "runs/sr1/checkpoints/step_000002/actor/rank0.pt",
    "cache/toy_world/index.faiss",
    "model/model.safetensors",
    "wandb/run-1/files/output.log",
    ".whl/vllm-0.31.0.whl",
    ".gl/blob",
    ".cache/huggingface/hub/x.bin",
    ".venv/lib/site.py",
    ".git/objects/pack/p.pack",
    "rsearch_verl/__pycache__/x.cpython-311.pyc",
]


def _packed(workdir: Path, excludes: list[str], tmp: Path) -> set[str]:
    from ray._private.runtime_env.packaging import _zip_files

    out = tmp / "pkg.zip"
    _zip_files(str(workdir), excludes, str(out), include_gitignore=False)
    with zipfile.ZipFile(out) as zf:
        return {name.rstrip("/") for name in zf.namelist()}


def _excludes() -> list[str]:
    with open(RUNTIME_ENV) as f:
        return yaml.safe_load(f)["excludes"]


def test_runtime_env_ships_code_and_leaves_bulk_behind(tmp_path):
    work = tmp_path / "work"
    for rel in CODE + BULK:
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text("x\n")
    with open(work / "indexes/wiki18_e5/index.faiss", "wb") as f:  # a big index (sparse: no disk used)
        f.truncate(600 << 20)
    packed = _packed(work, _excludes(), tmp_path)
    assert not [rel for rel in BULK if rel in packed], sorted(packed)
    assert set(CODE) <= packed


def test_this_checkout_packs_small(tmp_path):
    """This very checkout (with whatever outputs/ and caches it holds) packs to a few MB of code."""
    packed = _packed(ROOT, _excludes(), tmp_path)
    assert "rsearch_verl/data/parquet_data.py" in packed and "recipes/data/toy_world.yaml" in packed
    assert os.path.getsize(tmp_path / "pkg.zip") < 20 << 20


def test_submit_copy_carries_set_secrets_only(tmp_path):
    dst = tmp_path / "job_env.yaml"
    environ = {"RETRIEVER_TOKEN": "tok-123", "SERPER_API_KEY": "", "MY_JUDGE_KEY": "jk", "HOME": "/root"}
    forwarded = write_runtime_env(str(RUNTIME_ENV), str(dst), ["MY_JUDGE_KEY"], environ=environ)
    assert forwarded == ["RETRIEVER_TOKEN", "MY_JUDGE_KEY"]
    env = yaml.safe_load(dst.read_text())
    assert env["env_vars"]["RETRIEVER_TOKEN"] == "tok-123" and env["env_vars"]["MY_JUDGE_KEY"] == "jk"
    assert "SERPER_API_KEY" not in env["env_vars"] and "HOME" not in env["env_vars"]
    assert env["excludes"] == _excludes()
    assert stat.S_IMODE(dst.stat().st_mode) == 0o600
    assert "tok-123" not in RUNTIME_ENV.read_text()


def test_launch_scripts_name_their_mistakes(tmp_path):
    # retriever.sh is configured by environment variables: a stray `serve` (copied from the server's CLI) was ignored
    cmd = ["bash", "launch/retriever.sh", "serve"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "takes no arguments (got: serve)" in done.stderr
    # submit.sh runs the venv's programs, never `python` / `ray` from PATH; a missing one is named
    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:1", "PYTHON": str(tmp_path / "no_python")}
    done = subprocess.run(["bash", "launch/submit.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "no_python not found" in done.stderr
