"""Self-contained HTML viewer of a run's rollout dumps: what the policy wrote versus what the environment inserted.

    python -m rsearch_verl.eval.viewer RUN_DIR                     # last step -> RUN_DIR/rollouts/step_<N>.html
    python -m rsearch_verl.eval.viewer RUN_DIR --step 3 --out page.html [--tokenizer DIR]

Reads `RUN_DIR/rollouts/step_<N>.jsonl` (docs/architecture.md's dump line: prompt, response, response_ids,
response_mask, reward, n_searches, ground_truth, ...). Observation spans (mask 0, inserted by the environment) are
shown in `<span class="obs">` with a grey background, policy tokens plain. The spans come from the dump's
`segments` field when present (`[[text, 0|1], ...]`; the agent loop's `[role, text]` pairs work too); otherwise each
contiguous run of equal `response_mask` is decoded with the run's tokenizer (`--tokenizer DIR`, else `config.yaml` ->
`model.tokenizer_path` / `model.path`; nothing is downloaded); without either the response is shown unmarked.
The answer shown is the dump's `answer`, else the run's protocol's `extract_answer` (`protocol_for` on the run's
`config.yaml`; the default protocol when that does not load) on the policy segments, exactly as the rewards read it.

The page has inline CSS and JS only (no external resources) and every piece of text is HTML-escaped, so a
trajectory containing `<information>` or `<script>` shows as text. A filter box narrows trajectories by text and
by reward; `#q=TEXT` in the URL pre-fills it.
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import logging
import os
import re
from types import SimpleNamespace

import yaml

from rsearch_verl.config import RSearchConfig, from_omegaconf
from rsearch_verl.rollout.protocols import SearchProtocol, get_protocol, protocol_for
from rsearch_verl.segments import OBSERVATION as OBS_ROLE
from rsearch_verl.segments import POLICY as POLICY_ROLE

logger = logging.getLogger(__name__)

OBS, POLICY = 0, 1
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
DEFAULT_PROTOCOL = RSearchConfig().rollout.protocol  # the schema's default, for records that do not load


def find_steps(run_dir: str) -> list[int]:
    """Steps that have a rollout dump in `run_dir`, ascending."""
    paths = glob.glob(os.path.join(run_dir, "rollouts", "step_*.jsonl"))
    return sorted(int(m.group(1)) for p in paths if (m := _STEP_FILE.search(os.path.basename(p))))


def load_rollouts(run_dir: str, step: int) -> list[dict]:
    """The dump lines of `step` (a torn last line of a killed run is skipped with a warning)."""
    path = os.path.join(run_dir, "rollouts", f"step_{step}.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no rollout dump {path!r} (steps with dumps: {find_steps(run_dir)})")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("viewer: skipping unreadable line %d of %s", lineno, path)
    return rows


def load_run_config(run_dir: str) -> dict:
    """`RUN_DIR/config.yaml` as a plain dict ({} when absent). The run directory is a record written by an older or
    newer version of the code: callers read it leniently."""

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        logger.info("viewer: no config.yaml in %s", run_dir)
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def run_protocol(cfg: dict) -> SearchProtocol:
    """The run's search protocol, built from its config.yaml by the one function that builds a run's protocol
    (`protocol_for`, as training and evaluation do); the default protocol when the record does not load as this
    version's config (an older or newer run), so the page still renders."""
    if not cfg:
        return get_protocol(DEFAULT_PROTOCOL)
    try:
        return protocol_for(from_omegaconf(cfg))
    except Exception as exc:  # an unknown or renamed key or protocol must not stop the page; answers may read worse
        logger.warning("viewer: the run's config does not load (%s); reading answers as %s", exc, DEFAULT_PROTOCOL)
        return get_protocol(DEFAULT_PROTOCOL)


def _local_source(name: str | None, run_dir: str) -> str | None:
    """`name` if it can be loaded without a download: the built-in 'tiny' / 'qwen2.5' or an existing directory."""
    if not name:
        return None
    if name in ("tiny", "qwen2.5"):
        return name
    for candidate in (name, os.path.join(run_dir, name)):
        if os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


def load_run_tokenizer(run_dir: str):
    """The tokenizer the run used, from `RUN_DIR/config.yaml`, or None when it cannot be loaded offline."""
    cfg = load_run_config(run_dir)
    if not cfg:
        return None
    model = cfg.get("model") or {}
    tok_path = _local_source(model.get("tokenizer_path"), run_dir)
    model_path = _local_source(model.get("path"), run_dir)
    if tok_path is None and model.get("tokenizer_path"):
        logger.warning("viewer: tokenizer %r is not available locally", model["tokenizer_path"])
        return None
    if tok_path is None and model_path is None:
        logger.warning("viewer: model %r has no local tokenizer", model.get("path"))
        return None
    # the protocol's special tokens (R1-Searcher's markers) were added to the run's tokenizer: ids decode the same
    special = list(run_protocol(cfg).special_tokens)
    return load_tokenizer_from(tok_path, model_path, model.get("gguf_file"), special, model.get("family"))


def load_tokenizer_from(
    tokenizer_path: str | None, model_path: str | None = None, gguf_file=None, extra_special=(), family=None
):
    """Load through `rsearch_verl.models.load_tokenizer` (same rules as training); None with a warning on failure.
    `family`: the run's model.family (a tiny policy's tokenizer is its family's)."""
    # heavy: models imports torch/transformers; the viewer stays torch-free
    from rsearch_verl.models import load_tokenizer

    spec = SimpleNamespace(
        tokenizer_path=tokenizer_path, path=model_path or tokenizer_path, gguf_file=gguf_file, family=family
    )
    try:
        return load_tokenizer(spec, extra_special=extra_special)
    except Exception as exc:  # a broken tokenizer directory should degrade the page, not abort it
        logger.warning("viewer: could not load tokenizer %r: %s", tokenizer_path or model_path, exc)
        return None


def _mask_runs(ids: list[int], mask: list[int]) -> list[tuple[list[int], int]]:
    """Contiguous runs of equal mask value: [(ids, mask), ...]."""
    runs: list[tuple[list[int], int]] = []
    for tok, m in zip(ids, mask, strict=True):
        m = OBS if int(m) == 0 else POLICY
        if runs and runs[-1][1] == m:
            runs[-1][0].append(int(tok))
        else:
            runs.append(([int(tok)], m))
    return runs


_ROLE_MASK = {"observation": OBS, "obs": OBS, "policy": POLICY}


def _segment(seg) -> tuple[str, int]:
    """One dump segment as (text, mask). Accepted shapes: [text, 0|1], {"text", "mask"}, and the agent loop's
    own ("policy" | "observation", text) / {"role", "text"}, so dumps written by either side read the same."""
    if isinstance(seg, dict):
        text, m = seg["text"], seg["mask"] if "mask" in seg else seg["role"]
    else:
        first, second = seg
        text, m = (second, first) if isinstance(first, str) and first in _ROLE_MASK else (first, second)
    if isinstance(m, str):
        return str(text), _ROLE_MASK[m]
    return str(text), OBS if int(m) == 0 else POLICY


def response_segments(row: dict, tokenizer=None) -> list[tuple[str, int | None]]:
    """The response as [(text, mask)] with mask 0 = observation, 1 = policy, None = unknown.

    Order of preference: the dump's own `segments` (exact text, no tokenizer needed), then decoding each run of
    equal `response_mask` with `tokenizer`, then the plain `response` as one unmarked span.
    """
    segments = row.get("segments")
    if segments:
        try:
            return [_segment(seg) for seg in segments]
        except (KeyError, TypeError, ValueError) as exc:  # a malformed field degrades to the next source
            logger.warning("viewer: %s has unreadable segments (%s)", row.get("uid"), exc)
    ids, mask = row.get("response_ids"), row.get("response_mask")
    if tokenizer is not None and ids and mask and len(ids) == len(mask):
        if max(ids) < len(tokenizer):
            return [
                (tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False), m)
                for run, m in _mask_runs(ids, mask)
            ]
        logger.warning("viewer: %s has ids beyond the tokenizer's vocabulary; not decoding", row.get("uid"))
    return [(str(row.get("response") or ""), None)]


def extract_answer(row: dict, segments: list[tuple[str, int | None]], protocol: SearchProtocol) -> str | None:
    """The dump's `answer` if present, else `protocol.extract_answer` on the policy segments (never an answer quoted
    in a document); a response shown unmarked (no mask known) is read as a string without a mask."""
    if row.get("answer") is not None:
        return str(row["answer"])
    if any(m is None for _, m in segments):
        return protocol.extract_answer("".join(text for text, _ in segments))
    return protocol.extract_answer([(OBS_ROLE if m == OBS else POLICY_ROLE, text) for text, m in segments])


def _fmt_truth(value) -> str:
    if isinstance(value, dict) and "target" in value:
        value = value["target"]
    if isinstance(value, (list, tuple)):
        return " | ".join(str(v) for v in value)
    return "" if value is None else str(value)


def _fmt_num(value, digits: int = 3) -> str:
    return "–" if value is None else f"{float(value):.{digits}f}"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d1f23}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #d0d4da;padding:10px 16px;z-index:1}
h1{font-size:20px;margin:0 0 6px}
.summary span{margin-right:16px}
.controls{margin-top:8px}
#filter{width:320px;padding:4px 6px}
main{padding:12px 16px}
.traj{background:#fff;border:1px solid #d0d4da;border-radius:6px;margin:0 0 12px;padding:10px 12px}
.meta{font-size:13px;margin-bottom:6px}
.meta b{font-weight:600}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-weight:600}
.good{background:#1f8a4c}.bad{background:#b3261e}
pre{white-space:pre-wrap;word-break:break-word;font:13px/1.45 ui-monospace,Menlo,Consolas,monospace;margin:4px 0}
.prompt{color:#555}
.obs{background:#cfd3d8;color:#3a3f45;border-radius:2px}
.raw{border-left:3px solid #e0a800;padding-left:6px}
.legend .pol{border:1px solid #d0d4da;padding:0 4px}
.legend .obs{padding:0 4px}
.hidden{display:none}
"""

# Filters by text and reward; '#q=TEXT' pre-fills the box so a link (or a headless browser test) can share a view.
_JS = """
(function(){
  var box=document.getElementById('filter'),pos=document.getElementById('positive'),
      shown=document.getElementById('shown'),items=document.querySelectorAll('.traj');
  function apply(){
    var q=box.value.toLowerCase(),n=0;
    items.forEach(function(el){
      var ok=(!q||el.textContent.toLowerCase().indexOf(q)>=0)&&(!pos.checked||parseFloat(el.dataset.reward)>0);
      el.classList.toggle('hidden',!ok);if(ok){n++;}
    });
    shown.textContent='showing '+n+' of '+items.length;
  }
  var m=/[#&]q=([^&]*)/.exec(location.hash);if(m){box.value=decodeURIComponent(m[1]);}
  box.addEventListener('input',apply);pos.addEventListener('change',apply);apply();
})();
"""


def _render_response(segments: list[tuple[str, int | None]]) -> str:
    parts = []
    for text, m in segments:
        if m == OBS:
            parts.append(f'<span class="obs">{html.escape(text)}</span>')
        elif m is None:
            parts.append(f'<span class="raw">{html.escape(text)}</span>')
        else:
            parts.append(html.escape(text))
    return "".join(parts)


def _render_traj(index: int, row: dict, tokenizer, protocol: SearchProtocol) -> tuple[str, dict]:
    """One <article> and its stats (observation / total token counts, and the same in characters)."""
    segments = response_segments(row, tokenizer)
    answer = extract_answer(row, segments, protocol)
    reward = row.get("reward")
    good = reward is not None and float(reward) > 0
    mask = row.get("response_mask") or []
    fields = [
        f"<b>#{index}</b> uid {html.escape(str(row.get('uid', index)))}",
        f'reward <span class="badge {"good" if good else "bad"}">{_fmt_num(reward)}</span>',
        f"searches <b>{int(row.get('n_searches') or 0)}</b>",
        f"answer <b>{html.escape(answer) if answer is not None else '–'}</b>",
        f"ground truth <b>{html.escape(_fmt_truth(row.get('ground_truth')))}</b>",
    ]
    if row.get("data_source"):
        fields.append(f"source {html.escape(str(row['data_source']))}")
    if mask:
        fields.append(f"tokens {len(mask)} ({len(mask) - sum(1 for m in mask if m)} observation)")
    note = "" if all(m is not None for _, m in segments) else " (no tokenizer: observation spans not marked)"
    article = (
        f'<article class="traj" data-reward="{_fmt_num(reward) if reward is not None else "0"}" '
        f'data-searches="{int(row.get("n_searches") or 0)}">\n'
        f'<div class="meta">{" · ".join(fields)}</div>\n'
        f'<details><summary>prompt</summary><pre class="prompt">{html.escape(str(row.get("prompt") or ""))}</pre>'
        f"</details>\n<div>response{note}</div>\n"
        f'<pre class="response">{_render_response(segments)}</pre>\n</article>'
    )
    stats = {
        "obs": sum(1 for m in mask if not m),
        "total": len(mask),
        "obs_chars": sum(len(text) for text, m in segments if m == OBS),
        "chars": sum(len(text) for text, m in segments if m is not None),
    }
    return article, stats


def render_html(
    rows: list[dict], step: int, tokenizer=None, title: str | None = None, protocol: SearchProtocol | None = None
) -> str:
    """The whole page for `rows` (dump lines of one step) as a string; answers read by `protocol` (the run's;
    default search_r1)."""
    protocol = protocol or get_protocol(DEFAULT_PROTOCOL)
    articles, totals = [], {"obs": 0, "total": 0, "obs_chars": 0, "chars": 0}
    for i, row in enumerate(rows):
        article, stats = _render_traj(i, row, tokenizer, protocol)
        articles.append(article)
        totals = {k: totals[k] + stats[k] for k in totals}
    rewards = [float(r["reward"]) for r in rows if r.get("reward") is not None]
    searches = [int(r.get("n_searches") or 0) for r in rows]
    n = max(len(rows), 1)
    summary = [
        f"step <b>{step}</b>",
        f"trajectories <b>{len(rows)}</b>",
        f"mean reward <b>{_fmt_num(sum(rewards) / len(rewards) if rewards else None)}</b>",
        f"mean searches <b>{sum(searches) / n:.2f}</b>",
        f"searched at least once <b>{100 * sum(1 for s in searches if s > 0) / n:.0f}%</b>",
    ]
    # Token share when the dump has masks (what the loss sees), else the character share of the marked text.
    if totals["total"]:
        summary.append(f"observation tokens <b>{100 * totals['obs'] / totals['total']:.1f}%</b>")
    elif totals["chars"]:
        summary.append(f"observation text <b>{100 * totals['obs_chars'] / totals['chars']:.1f}%</b> of characters")
    title = html.escape(title or f"rollouts, step {step}")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<header>\n<h1>{title}</h1>\n"
        f'<div class="summary">{"".join(f"<span>{s}</span>" for s in summary)}</div>\n'
        '<div class="controls legend"><input id="filter" type="search" placeholder="filter trajectories by text">'
        ' <label><input id="positive" type="checkbox"> reward &gt; 0 only</label> · <span id="shown"></span>'
        ' &nbsp; legend: <span class="pol">policy tokens (trained)</span>'
        ' <span class="obs">observation tokens (mask 0, inserted by the environment)</span></div>\n'
        "</header>\n<main>\n" + "\n".join(articles) + f"\n</main>\n<script>{_JS}</script>\n</body>\n</html>\n"
    )


def write_viewer(run_dir: str, step: int | None = None, out: str | None = None, tokenizer="auto") -> str:
    """Write the page for `step` (default: the last dumped step); returns its path.

    `tokenizer`: "auto" (from the run's config.yaml), None (no decoding), or a tokenizer object.
    """
    if step is None:
        steps = find_steps(run_dir)
        if not steps:
            raise FileNotFoundError(f"no rollouts/step_*.jsonl in run directory {run_dir!r}")
        step = steps[-1]
    rows = load_rollouts(run_dir, step)
    if isinstance(tokenizer, str) and tokenizer == "auto":
        # Only dumps without `segments` need token decoding; loading a tokenizer can take seconds.
        tokenizer = None if all(r.get("segments") for r in rows) else load_run_tokenizer(run_dir)
    out = out or os.path.join(run_dir, "rollouts", f"step_{step}.html")
    title = f"{os.path.basename(os.path.abspath(run_dir))}: step {step}"
    page = render_html(rows, step, tokenizer, title=title, protocol=run_protocol(load_run_config(run_dir)))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    logger.info("viewer: %d trajectories of step %d -> %s", len(rows), step, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.eval.viewer", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding rollouts/step_<N>.jsonl")
    parser.add_argument("--step", type=int, default=None, help="step to show (default: the last dumped step)")
    parser.add_argument("--out", default=None, help="output HTML file (default: RUN_DIR/rollouts/step_<N>.html)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: from RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = load_tokenizer_from(args.tokenizer) if args.tokenizer else "auto"
    try:
        path = write_viewer(args.run_dir, args.step, args.out, tokenizer=tokenizer)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    print(path)  # noqa: T201 - CLI output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
