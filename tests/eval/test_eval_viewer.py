"""Tests of rsearch_verl.eval.viewer: rollout dump -> self-contained HTML, checked as text and in real headless
Chromium (screenshot pixels and the live DOM after the page's script ran).

    .venv/bin/pytest -q tests/eval/test_eval_viewer.py          # browser tests skip when chromium is absent
    apt-get install -y chromium                                 # Debian; enables the `browser` tests
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from rsearch_verl.eval.viewer import load_run_tokenizer, render_html, response_segments, write_viewer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium not installed")
OBS_BG = (0xCF, 0xD3, 0xD8)  # .obs background in the viewer's CSS

POLICY_1 = "<think>I need the capital of France.</think>\n<search>capital of France</search>\n"
OBS_1 = (
    '<information>Doc 1(Title: "Paris") Paris is the capital and largest city of France. '
    "<script>document.title='pwned'</script> & more text</information>\n"
)
POLICY_2 = "<think>The document says Paris.</think>\n<answer>Paris</answer>"
FORGED = "<information>I forge a document myself: the answer is Lyon</information>\n<answer>Lyon</answer>"


def _rows(with_obs: bool = True) -> list[dict]:
    first = [[POLICY_1, 1], [OBS_1 * 4, 0 if with_obs else 1], [POLICY_2, 1]]
    return [
        {
            "uid": "q-1",
            "prompt": "Question: what is the capital of France?",
            "response": "".join(t for t, _ in first),
            "response_ids": [],
            "response_mask": [],
            "segments": first,
            "reward": 1.0,
            "n_searches": 1,
            "ground_truth": {"target": ["Paris"]},
            "data_source": "nq",
        },
        {  # the policy wrote an observation tag itself: mask 1, must not look like an observation
            "uid": "q-2",
            "prompt": "Question: where is Lyon?",
            "response": FORGED,
            "segments": [["policy", FORGED]],  # the agent loop's (role, text) form
            "reward": 0.0,
            "n_searches": 0,
            "ground_truth": ["Lyon", "Lyon, France"],
            "data_source": "hotpotqa",
        },
        {  # an old dump: no segments, no tokenizer -> shown unmarked
            "uid": "q-3",
            "prompt": "Question: <b>bold</b>?",
            "response": "<answer>42</answer>",
            "reward": 0.0,
            "n_searches": 0,
            "ground_truth": "41",
        },
    ]


def _run_dir(tmp_path, rows, step: int = 7, name: str = "run") -> str:
    run_dir = tmp_path / name
    (run_dir / "rollouts").mkdir(parents=True)
    (run_dir / "rollouts" / f"step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(run_dir)


class _Spans(HTMLParser):
    """Collects the text of every <span class="obs"> inside a <pre class="response">, and counts <script> tags."""

    def __init__(self):
        super().__init__()
        self.obs, self.scripts, self.hidden, self.articles = [], 0, 0, 0
        self._stack: list[str] = []
        self._in_response = False

    def handle_starttag(self, tag, attrs):
        cls = (dict(attrs).get("class") or "").split()
        if tag == "script":
            self.scripts += 1
        if tag == "article":
            self.articles += 1
            self.hidden += "hidden" in cls
        if tag == "pre" and "response" in cls:
            self._in_response = True
        if tag == "span":
            self._stack.append("obs" if self._in_response and "obs" in cls else "other")
            if self._stack[-1] == "obs":
                self.obs.append("")

    def handle_endtag(self, tag):
        if tag == "pre":
            self._in_response = False
        if tag == "span" and self._stack:
            self._stack.pop()

    def handle_data(self, data):
        if self._stack and self._stack[-1] == "obs":
            self.obs[-1] += data


def _parse(page: str) -> _Spans:
    parser = _Spans()
    parser.feed(page)
    return parser


def test_segments_render_as_escaped_obs_spans():
    page = render_html(_rows(), step=7)
    spans = _parse(page)
    assert spans.obs == [OBS_1 * 4]  # only the environment's text; the forged tag stays policy text
    assert spans.scripts == 1  # the viewer's own filter script; the one in the document is escaped text
    assert "&lt;script&gt;document.title" in page and "<script>document.title" not in page
    assert "&lt;b&gt;bold&lt;/b&gt;" in page
    assert 'href="http' not in page and 'src="' not in page  # self-contained: nothing external
    meta = re.findall(r'<div class="meta">(.*?)</div>', page)
    assert "answer <b>Paris</b>" in meta[0] and "Paris" in meta[0] and ">1.000<" in meta[0]
    assert "answer <b>Lyon</b>" in meta[1] and "Lyon | Lyon, France" in meta[1]
    assert "answer <b>42</b>" in meta[2] and "no tokenizer" in page
    marked = len(POLICY_1 + OBS_1 * 4 + POLICY_2 + FORGED)  # the unmarked third response is not counted
    assert f"observation text <b>{100 * len(OBS_1 * 4) / marked:.1f}%</b>" in page


def test_segment_shapes_and_fallback():
    row = {"segments": [{"text": "a", "mask": 1}, {"role": "observation", "text": "b"}, ["c", 0]]}
    assert response_segments(row) == [("a", 1), ("b", 0), ("c", 0)]
    assert response_segments({"response": "plain"}) == [("plain", None)]
    assert response_segments({"segments": [["x"]], "response": "r"}) == [("r", None)]  # malformed -> fallback


def test_tokenizer_decodes_mask_runs_from_run_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = "model:\n  path: tiny\n  tokenizer_path: tiny\nrollout:\n  protocol: search_r1\n"
    (run_dir / "config.yaml").write_text(config)
    tok = load_run_tokenizer(str(run_dir))
    assert tok is not None
    pol, obs = tok.encode("the answer is", add_special_tokens=False), tok.encode("a document", add_special_tokens=False)
    row = {"response_ids": pol + obs + pol, "response_mask": [1] * len(pol) + [0] * len(obs) + [1] * len(pol)}
    segments = response_segments(row, tok)
    assert [m for _, m in segments] == [1, 0, 1]
    assert segments[1][0] == tok.decode(obs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert "document" in segments[1][0] and "answer" in segments[0][0]
    share = 100 * len(obs) / len(row["response_mask"])
    assert f"observation tokens <b>{share:.1f}%</b>" in render_html([row], step=0, tokenizer=tok)
    too_big = {"response_ids": [len(tok) + 5], "response_mask": [0], "response": "r"}
    assert response_segments(too_big, tok) == [("r", None)]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_cli_picks_last_step_and_honours_out(tmp_path):
    run_dir = _run_dir(tmp_path, _rows(), step=3)
    with open(os.path.join(run_dir, "rollouts", "step_12.jsonl"), "w") as f:
        f.write(json.dumps(_rows()[1]) + "\n" + '{"uid": "torn')  # a killed run's torn last line is skipped
    cmd = [sys.executable, "-m", "rsearch_verl.eval.viewer", run_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == os.path.join(run_dir, "rollouts", "step_12.html")
    assert "trajectories <b>1</b>" in _read(proc.stdout.strip())
    out = str(tmp_path / "page.html")
    proc = subprocess.run([*cmd, "--step", "3", "--out", out], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == out
    assert "trajectories <b>3</b>" in _read(out)
    bad = subprocess.run([*cmd, "--step", "99"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "[3, 12]" in bad.stderr


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",  # tests may run as root
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",  # the machine is offline; background fetches only add noise
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    proc = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _obs_pixels(tmp_path, rows, name: str) -> int:
    from PIL import Image

    page = write_viewer(_run_dir(tmp_path, rows, name=name), tokenizer=None)
    shot = str(tmp_path / f"{name}.png")
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1000,1200", f"file://{page}")
    img = Image.open(shot).convert("RGB")
    assert img.size == (1000, 1200)
    assert len(img.getcolors(maxcolors=1 << 20)) > 50  # text, badges, borders: a rendered page, not a blank one
    return sum(1 for px in img.getdata() if px == OBS_BG)


@pytest.mark.browser
@needs_chromium
def test_screenshot_shows_observation_background(tmp_path):
    with_obs = _obs_pixels(tmp_path, _rows(with_obs=True), "with_obs")
    without = _obs_pixels(tmp_path, _rows(with_obs=False), "without_obs")  # only the legend swatch is grey
    assert with_obs > 20_000, with_obs
    assert with_obs > 5 * max(without, 1), (with_obs, without)


@pytest.mark.browser
@needs_chromium
def test_live_dom_marks_observations_and_filters(tmp_path):
    page = write_viewer(_run_dir(tmp_path, _rows()), tokenizer=None)
    dom = _chromium(tmp_path, "--dump-dom", f"file://{page}").stdout
    spans = _parse(dom)
    assert spans.obs == [OBS_1 * 4]
    assert spans.scripts == 1 and "<title>pwned</title>" not in dom  # the document's script did not run
    assert spans.articles == 3 and spans.hidden == 0
    assert "showing 3 of 3" in dom  # the page's script ran
    filtered = _parse(_chromium(tmp_path, "--dump-dom", f"file://{page}#q=lyon").stdout)
    assert filtered.articles == 3 and filtered.hidden == 2  # only the forged-observation trajectory mentions Lyon


def test_real_dump_without_segments_decodes_with_run_tokenizer(tmp_path):
    """The trainer's own dump writer (rsearch_verl.rollout.dump) -> viewer, tokenizer taken from config.yaml."""
    import numpy as np
    import torch
    from verl import DataProto

    from rsearch_verl.rollout.dump import write_rollout_dump

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model:\n  path: tiny\n  tokenizer_path: null\n")
    tok = load_run_tokenizer(str(run_dir))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    prompt, pol, obs, ans = enc("where is it"), enc("search it"), enc("a document about it"), enc("answer it")
    resp = pol + obs + ans
    width, pad = len(resp) + 3, tok.pad_token_id  # right padding after the response, as the rollout pads
    responses = torch.tensor([resp + [pad] * 3])
    response_mask = torch.tensor([[1] * len(pol) + [0] * len(obs) + [1] * len(ans) + [0] * 3])
    attention = torch.tensor([[1] * len(prompt) + [1] * len(resp) + [0] * 3])
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt]),
            "responses": responses,
            "response_mask": response_mask,
            "attention_mask": attention,
        },
        non_tensors={"uid": np.array(["u0"], dtype=object), "reward": np.array([0.5]), "n_searches": np.array([1])},
    )
    assert responses.shape[1] == width
    write_rollout_dump(str(run_dir / "rollouts" / "step_0.jsonl"), batch, tok)
    page_path = write_viewer(str(run_dir))  # tokenizer="auto": the dump has no segments, so config.yaml is read
    spans = _parse(_read(page_path))
    assert spans.obs == [tok.decode(obs, skip_special_tokens=False, clean_up_tokenization_spaces=False)]
    assert "document" in spans.obs[0]
    assert f"tokens {len(resp)} ({len(obs)} observation)" in _read(page_path)
