"""The evaluation protocol card: under which settings each paper measured its numbers, and where this run differs.

Numbers of search-agent papers are comparable only under the same datasets, split sizes, corpus, retriever, top-k
and metric, and the five papers this project implements differ on every one of them. `python -m rsearch_verl.eval`
prints this card under its scores table, so a number says what it is comparable to:

    run = run_settings(cfg, {"nq": 500, "hotpotqa": 500})      # what this evaluation used
    print(format_card(run))                                     # one block per paper, each difference flagged

The facts are those stated in the papers (docs/eval_protocols.md quotes them); "not stated" is never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# data_source spellings -> one canonical dataset name
_ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "trivia": "triviaqa", "nq_open": "nq"}
SEVEN = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


@dataclass(frozen=True)
class EvalProtocol:
    """One paper's evaluation setting. `sizes`: examples per dataset where the paper states them."""

    system: str
    paper: str
    datasets: tuple[str, ...]
    sizes: dict[str, int] = field(default_factory=dict)
    splits: str = "not stated"
    corpus: str = "not stated"  # a corpus label, compared with retriever.corpus_name
    retriever: str = "not stated"  # an encoder name, compared with retriever.encoder
    topk: int | None = None
    metrics: tuple[str, ...] = ()  # em | f1 | cover_em | judge (LLM-as-judge) | accuracy


PROTOCOLS: tuple[EvalProtocol, ...] = (
    EvalProtocol(
        "Search-R1",
        "Search-R1: Training LLMs to Reason and Leverage Search Engines with Reinforcement Learning",
        SEVEN,
        splits="test or validation set of each dataset (sizes not stated)",
        corpus="wiki-2018",
        retriever="e5",
        topk=3,
        metrics=("em",),
    ),
    EvalProtocol(
        "ReSearch",
        "ReSearch: Learning to Reason with Search for LLMs via Reinforcement Learning",
        ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle"),
        sizes={"hotpotqa": 7405, "2wikimultihopqa": 12576, "musique": 2417, "bamboogle": 125},
        splits="full dev sets; Bamboogle test set",
        corpus="wiki-2018",
        retriever="e5",
        topk=5,
        metrics=("em", "judge"),
    ),
    EvalProtocol(
        "R1-Searcher",
        "R1-Searcher: Incentivizing the Search Capability in LLMs via Reinforcement Learning",
        ("hotpotqa", "2wikimultihopqa", "bamboogle", "musique"),
        splits="evaluated with FlashRAG (sizes not stated)",
        corpus="kilt-wiki-2019",
        retriever="bge",
        metrics=("cover_em", "judge"),
    ),
    EvalProtocol(
        "R-Search (multi-reward)",
        "R-Search: Empowering LLM Reasoning with Search via Multi-Reward Reinforcement Learning",
        SEVEN,
        sizes={d: 500 for d in ("hotpotqa", "2wikimultihopqa", "musique", "nq", "popqa", "triviaqa")}
        | {"bamboogle": 125},
        splits="Trivedi et al. test splits (multi-hop), 500 sampled from FlashRAG test sets (single-hop)",
        corpus="wiki-2018 (NQ, TriviaQA, PopQA, Bamboogle); per-dataset Trivedi et al. corpora (others)",
        retriever="e5",
        topk=5,
        metrics=("f1", "em"),
    ),
    EvalProtocol(
        "R-Search (NL-DAG)",
        "Reinforcement Fine-Tuning for Reasoning towards Multi-Step Multi-Source Search in Large Language Models",
        SEVEN,
        splits="as Search-R1 and ZeroSearch (sizes not stated)",
        corpus="not stated for the QA benchmarks (live web and news search for its own benchmarks)",
        topk=2,
        metrics=("em",),
    ),
)


def canonical(name: str) -> str:
    """A dataset name as the card compares it ("2wiki" and "2WikiMultihopQA" are one dataset)."""
    key = name.strip().lower().replace("-", "").replace(" ", "")
    return _ALIASES.get(key, key)


def run_settings(cfg, sizes: dict[str, int]) -> dict:
    """This evaluation's settings: datasets with their example counts, corpus label, encoder, top-k, metrics."""
    return {
        "sizes": {canonical(k): int(v) for k, v in sizes.items()},
        "corpus": cfg.retriever.corpus_name or "unknown (set retriever.corpus_name)",
        "retriever": cfg.retriever.encoder,
        "topk": cfg.retriever.topk,
        "metrics": ("em", "f1", "cover_em"),
    }


def differences(proto: EvalProtocol, run: dict) -> list[str]:
    """Every setting of `run` that differs from `proto` (empty: the numbers are comparable)."""
    out = []
    ours, theirs = set(run["sizes"]), set(proto.datasets)
    if ours - theirs:
        out.append(f"datasets not in the paper: {', '.join(sorted(ours - theirs))}")
    if theirs - ours:
        out.append(f"paper datasets not evaluated: {', '.join(sorted(theirs - ours))}")
    for name in sorted(ours & set(proto.sizes)):
        if run["sizes"][name] != proto.sizes[name]:
            out.append(f"{name}: {run['sizes'][name]} examples, the paper {proto.sizes[name]}")
    if run["corpus"] != proto.corpus:
        out.append(f"corpus {run['corpus']!r}, the paper {proto.corpus!r}")
    if run["retriever"] != proto.retriever:
        out.append(f"retriever {run['retriever']!r}, the paper {proto.retriever!r}")
    if run["topk"] != proto.topk:
        out.append(f"top-k {run['topk']}, the paper {proto.topk if proto.topk is not None else 'not stated'}")
    missing = [m for m in proto.metrics if m not in run["metrics"]]
    if missing:
        out.append(f"paper metric(s) not computed here: {', '.join(missing)}")
    return out


def format_card(run: dict, protocols: tuple[EvalProtocol, ...] = PROTOCOLS) -> str:
    """The card as text: this run's settings, then per paper its protocol and the flagged differences."""
    sizes = ", ".join(f"{k} {v}" for k, v in sorted(run["sizes"].items()))
    lines = [
        "evaluation protocol card (docs/eval_protocols.md)",
        f"this run: {sizes}; corpus {run['corpus']}; retriever {run['retriever']}, top-{run['topk']}; "
        f"metrics {', '.join(run['metrics'])} (SQuAD normalisation, cover EM = gold is a substring)",
    ]
    for proto in protocols:
        lines.append(
            f"- {proto.system}: {', '.join(proto.datasets)}; {proto.splits}; corpus {proto.corpus}; "
            f"retriever {proto.retriever}, top-{proto.topk or '?'}; metrics {', '.join(proto.metrics)}"
        )
        diffs = differences(proto, run)
        lines += [f"    DIFFERS: {d}" for d in diffs] or ["    comparable: same settings"]
    return "\n".join(lines)
