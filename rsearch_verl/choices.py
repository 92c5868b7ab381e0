"""The names a recipe picks implementations by, with the keyword arguments each one accepts: the vocabulary that the
config validates (rsearch_verl/config/validation.py) and that the registries implement.

It sits on the bottom floor (imports nothing above it), so the config checks a recipe's names when it is loaded without
importing the rollout or the rewards that hold the code behind them. Each registry checks, when it registers a name,
that it implements exactly what is declared here, so a name or an argument cannot be added on one side only:

    rollout.engine                      ENGINES          rsearch_verl/rollout/engines/ (make_engine)
    model.family                        MODEL_FAMILIES   rsearch_verl/model_families.py
    rollout.prompt_variant              PROMPT_VARIANTS  rsearch_verl/rollout/protocols/ (build_prompt)
    rollout.protocol, .protocol_kwargs  PROTOCOL_KWARGS  rsearch_verl/rollout/protocols/ (the constructor's parameters)
    reward.name, reward.kwargs          REWARD_KWARGS    rsearch_verl/rewards/ (the function's keyword-only parameters)
    rollout.tools                       TOOL_NAMES       rsearch_verl/rollout/tools/ (or a `pkg.module:Class` plug-in)

    check_parameters(PROTOCOL_KWARGS, "protocol", "nl_dag", ["tools", "max_nodes"])   # TypeError on any difference
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ENGINES = ("hf", "vllm")
# model.family: the tiny policy's architecture / tokenizer / template, a pretrained model's conventions
# (rsearch_verl/model_families.py)
MODEL_FAMILIES = ("qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "llama3")
# families whose linear-attention layers carry a recurrent state (Qwen3.5 / 3.6: Gated DeltaNet): no packed training
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
ROUND_TRIP_CHECKS = ("auto", "on", "off")  # rollout.round_trip_check (rsearch_verl/rollout/round_trip.py)
# a protocol's prompt variants: a string for base models, chat messages for instruct models
PROMPT_VARIANTS = ("base", "instruct")

# rollout.tools: the built-in tools (rsearch_verl/rollout/tools/; a plug-in is named `pkg.module:Class`)
TOOL_NAMES = ("open", "search")

# rollout.protocol -> the rollout.protocol_kwargs it accepts (its constructor's parameters, in order)
PROTOCOL_KWARGS: dict[str, tuple[str, ...]] = {
    "nl_dag": ("tools", "max_nodes"),
    "r1_searcher": (),
    "r_search": (),
    "research": (),
    "search_r1": (),
    "tool_call": ("enable_thinking", "max_queries", "call_format"),
}

# reward.name -> the reward.kwargs it accepts (the reward function's keyword-only parameters, in order)
REWARD_KWARGS: dict[str, tuple[str, ...]] = {
    "r1_searcher_stage1": ("max_answer_words",),
    "r1_searcher_stage2": ("max_answer_words", "format_penalty"),
    "r_search_dag": ("judge", "tools", "max_nodes", "weights"),
    "r_search_evidence": ("judge", "gamma_e", "gamma_a"),
    "research_f1": (),
    "search_r1_em": ("format_shaped", "structure_format_score", "final_format_score", "retrieval_score"),
}


def check_parameters(table: Mapping[str, tuple[str, ...]], kind: str, name: str, params: Sequence[str]) -> None:
    """Raise TypeError unless `table` declares `name` with exactly `params` (the implementation's, in order)."""
    if name not in table:
        raise TypeError(f"{kind} {name!r} is not declared in rsearch_verl/choices.py (declared: {sorted(table)})")
    if tuple(params) != table[name]:
        raise TypeError(
            f"{kind} {name!r} accepts {list(params)} but rsearch_verl/choices.py declares {list(table[name])}"
        )
