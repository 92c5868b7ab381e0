"""The evaluation protocol card: the papers' settings and the differences it flags for a run."""

from rsearch_verl.config import load_config
from rsearch_verl.eval.protocol_card import PROTOCOLS, canonical, differences, format_card, run_settings


def _paper(system: str):
    return next(p for p in PROTOCOLS if p.system == system)


def test_a_run_in_the_papers_settings_is_comparable():
    research = _paper("ReSearch")
    run = {"sizes": dict(research.sizes), "corpus": "wiki-2018", "retriever": "e5", "topk": 5}
    run["metrics"] = ("em", "f1", "cover_em", "judge")
    assert differences(research, run) == []
    assert "comparable: same settings" in format_card(run, (research,))


def test_every_differing_setting_is_flagged():
    cfg = load_config(["+recipe=search_r1_ppo", "retriever=wiki18_e5"])
    run = run_settings(cfg, {"nq": 500, "HotpotQA": 7405, "2wiki": 100, "toyqa": 3})
    assert run["sizes"] == {"nq": 500, "hotpotqa": 7405, "2wikimultihopqa": 100, "toyqa": 3}
    assert differences(_paper("Search-R1"), run) == [
        "datasets not in the paper: toyqa",
        "paper datasets not evaluated: bamboogle, musique, popqa, triviaqa",
    ]
    research = differences(_paper("ReSearch"), run)
    assert "2wikimultihopqa: 100 examples, the paper 12576" in research
    assert "hotpotqa: 7405 examples, the paper 7405" not in " ".join(research)
    assert "top-k 3, the paper 5" in research and "paper metric(s) not computed here: judge" in research
    searcher = differences(_paper("R1-Searcher"), run)
    assert (
        "corpus 'wiki-2018', the paper 'kilt-wiki-2019'" in searcher and "retriever 'e5', the paper 'bge'" in searcher
    )
    card = format_card(run)
    assert card.count("\n- ") == len(PROTOCOLS) and "DIFFERS: top-k 3, the paper 5" in card


def test_dataset_names_are_canonical():
    assert canonical("2WikiMultihopQA") == canonical("2wiki") == "2wikimultihopqa"
    assert canonical(" NQ ") == "nq"
