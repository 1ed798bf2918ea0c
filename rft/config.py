"""The typed config tree: every key rft understands, its default and a one-line doc.

YAML under `conf/` only selects and overrides these dataclasses; an unknown key fails at compose
time (Hydra structured configs are in struct mode). `validate()` (rft/config_checks.py) then checks
values and the filesystem before any process starts, raising `ValueError` that names the key, the
bad value and the fix. What is derived from a config (stages, world size, context length, sync
engine) lives here beside the tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from rft.data.config import JudgeDifficultyConfig, ReplayConfig, SelectorConfig


@dataclass
class TinyModelConfig:
    """A random-weight Qwen2 model with a character-level tokenizer, built locally (no download)."""

    num_layers: int = 2  # transformer layers
    hidden_size: int = 128  # model width
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 384  # SwiGLU inner width
    max_position_embeddings: int = 128  # longest sequence (prompt + response)
    tie_word_embeddings: bool = False  # share input embedding and output layer


@dataclass
class ModelConfig:
    name: str = MISSING  # short name used in logs
    path: str = MISSING  # HF model directory (config.json, weights, tokenizer)
    tiny: Optional[TinyModelConfig] = None  # if set, `path` is created from this config before launch
    dtype: str = "float32"  # float32 | bfloat16 | float16: trainer master weights and vLLM dtype
    chat_template: bool = False  # wrap prompts with the tokenizer's chat template
    max_seq_len: int = 4096  # longest prompt + response rft gives the model (capped by max_position_embeddings)
    needs_gpu: bool = False  # too big for CPU nodes: refuse to run where the ranks get no GPU


@dataclass
class ArithmeticTaskConfig:
    """Synthetic `a+b=` problems written to jsonl with a fixed seed before launch."""

    num_train: int = 2000  # training problems
    num_eval: int = 200  # held-out problems (disjoint from train)
    max_operand: int = 99  # operands are drawn from [0, max_operand]


@dataclass
class EnvTasksConfig:
    """Tasksets drawn by the environment itself (its `sample_tasks`, or `sample_demos` for SFT
    conversations), written to data.train_path / data.eval_path before launch."""

    kind: str = "tasks"  # tasks: rows the environment plays | demos: conversations to train on (SFT)
    num_train: int = 400  # rows in train_path
    num_eval: int = 100  # rows in eval_path (tasks, disjoint from train; demos: none)
    args: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of sample_tasks/sample_demos


@dataclass
class DataConfig:
    train_path: str = MISSING  # taskset for training: .jsonl or .parquet
    eval_path: Optional[str] = None  # held-out taskset for eval/accuracy (None: no eval)
    prompt_key: str = "question"  # column holding the prompt text
    answer_key: str = "answer"  # column holding the reference answer
    id_key: Optional[str] = None  # column holding a task id (None: the row's index)
    chosen_key: str = "chosen"  # preference data (DPO): the preferred response
    rejected_key: str = "rejected"  # preference data (DPO): the dispreferred response
    prompt_template: str = "{prompt}"  # format string applied to the prompt column
    eval_limit: Optional[int] = None  # evaluate on the first N eval rows (None: all)
    overlong: str = "skip"  # rows longer than the context: skip (counted) | truncate_left (cut the prompt's start) | error
    arithmetic: Optional[ArithmeticTaskConfig] = None  # if set, generate train/eval files before launch
    from_env: Optional[EnvTasksConfig] = None  # if set, rollout.env writes train/eval files before launch
    messages_key: str = "messages"  # SFT rows: a column of chat messages trains every assistant turn
    selector: SelectorConfig = field(default_factory=SelectorConfig)  # which tasks each step explores
    operators: list[Any] = field(default_factory=list)  # task operators run on train_path before the stage (rft/data/task_operators.py)
    judge_difficulty: JudgeDifficultyConfig = field(default_factory=JudgeDifficultyConfig)  # judges score each train task (rft/data/judge_difficulty.py)


LR_DECAYS = ("constant", "linear", "cosine")  # algorithm.lr_decay (rft/trainer/optimizer.py)


@dataclass
class AlgorithmConfig:
    """What a step computes. Presets: conf/algorithm/<name>.yaml (`algorithm=dapo`); the registry
    keys (advantage, policy_loss, kl_estimator, loss_agg, sample_filter) take a built-in name or a
    dotted path to your own function (signatures in rft/algorithms/*.py, checked at launch)."""

    name: str = "grpo"  # a label (the preset's name); the keys below decide what runs
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | gae (with a critic) (rft/algorithms/advantages.py)
    policy_loss: str = "ppo"  # ppo | gspo | cispo | sft | dpo (rft/algorithms/policy_losses.py); sft, dpo: no rollouts
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_norm_len: int = 0  # seq-mean-token-sum-norm's constant (0: rollout.max_new_tokens)
    sample_filter: str = "none"  # none | zero_variance (DAPO dynamic sampling; the explorer refills)
    group_size: int = 8  # samples per task (GRPO group)
    clip_eps: float = 0.2  # PPO ratio clip (lower side)
    clip_eps_high: Optional[float] = None  # upper side (DAPO clip-higher); None: clip_eps
    dual_clip_c: Optional[float] = None  # dual-clip bound for negative advantages (e.g. 3.0); None: off
    cispo_clip_high: float = 0.28  # CISPO: IS weight capped at 1 + this
    tis_cap: Optional[float] = None  # truncated IS between trainer and vLLM logprobs (e.g. 2.0); None: off
    norm_adv_by_std: bool = True  # divide group-centred rewards by the group std (GRPO)
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 1.0  # GAE lambda
    critic_lr: float = 1e-5  # gae: AdamW learning rate of the critic (value model, rft/trainer/critic.py)
    value_clip: Optional[float] = 0.2  # gae: the critic's values move at most this far from V_old per step; None: off
    kl_coef: float = 0.0  # weight of the KL to a frozen reference model (0: no reference)
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (rft/algorithms/kl.py)
    kl_mode: str = "loss"  # loss: a loss term | reward: a per-token reward penalty (reinforce_pp, gae)
    entropy_coef: float = 0.0  # entropy bonus weight
    dpo_beta: float = 0.1  # DPO: strength of the implicit KL to the reference (policy_loss=dpo, mode=train)
    reward: str = "exact_match"  # exact_match | math_verify | llm_judge (asks the judge engines) | dotted path
    ppo_epochs: int = 1  # passes over each rollout batch (old logprobs, advantages fixed for the batch)
    mini_batch_size: int = 0  # rows per optimizer step (0: the whole batch); steps = ppo_epochs x ceil(rows / this)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    warmup_steps: int = 0  # linear LR warm-up steps
    lr_decay: str = "constant"  # after warm-up: constant | linear | cosine (to min_lr_ratio x lr at the stage's end)
    min_lr_ratio: float = 0.0  # lr_decay linear/cosine: the last step's lr as a share of lr


@dataclass
class RolloutConfig:
    tasks_per_step: int = 16  # tasks per training step (each sampled group_size times)
    max_new_tokens: int = 256  # response length limit
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling for training rollouts
    eval_temperature: float = 0.0  # 0: greedy eval
    stop: list[str] = field(default_factory=list)  # extra stop strings
    kv_cache_gb: float = 1.0  # KV cache memory for vLLM (CPU: GiB of RAM)
    gpu_memory_utilization: float = 0.85  # share of GPU memory vLLM may use (GPU only)
    tensor_parallel_size: int = 1  # vLLM TP per engine
    max_num_seqs: int = 256  # vLLM scheduler batch limit
    reward_timeout_s: float = 10.0  # a reward call slower than this scores 0
    max_sampling_rounds: int = 3  # dynamic sampling (algorithm.sample_filter): generation rounds per step
    workflow: str = "single_turn"  # single_turn | multi_turn | step_wise | dotted path (rft/explorer/workflows/)
    env: Optional[str] = None  # multi_turn/step_wise: grid_world | calculator | dotted path to a Gymnasium Env class
    env_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's constructor
    max_turns: int = 8  # multi_turn/step_wise: model turns per episode
    max_concurrent_tasks: int = 256  # trajectories in flight at once (a workflow waiting on a tool holds one)
    task_timeout_s: float = 600.0  # a workflow try running longer is cancelled (and retried)
    max_retries: int = 1  # tries after the first for a sample whose workflow raised or timed out
    openai_api: bool = False  # every engine also serves vLLM's OpenAI API; rewarded sessions join the step's experience
    on_engine_failure: str = "fail"  # fail: a lost engine ends the job, naming it | continue: the other engines take its tasks
    openai_port: int = 0  # engine e listens on openai_port + e (0: any free port); URLs in <run>/endpoints.json


@dataclass
class JudgeConfig:
    """Frozen vLLM engines on `cluster.judge_ranks` that rewards ask (`await judge.chat(...)`)."""

    kind: str = "generate"  # generate: an LLM judge (judge.chat / judge.complete) | classify: a reward model, an HF sequence-classification model (judge.score)
    model: Optional[str] = None  # HF model directory of the judge (None: the policy's starting weights, model.path)
    tensor_parallel_size: int = 1  # vLLM TP per judge engine (on GPU nodes: tasks per judge engine)
    timeout_s: float = 30.0  # a judge call slower than this fails (the reward scores 0, judge/timeouts counts it)
    max_new_tokens: int = 64  # default length of a judge's answer
    temperature: float = 0.0  # default sampling temperature of the judge (0: greedy)
    kv_cache_gb: float = 1.0  # KV cache memory of each judge engine (CPU: GiB of RAM)
    gpu_memory_utilization: float = 0.85  # share of GPU memory a judge engine may use (GPU only)
    max_num_seqs: int = 256  # vLLM scheduler batch limit: concurrent judge calls are batched up to this


@dataclass
class ServeConfig:
    """mode=serve (rft/explorer/serve.py): rollout ranks that only serve the OpenAI endpoint."""

    step_s: float = 10.0  # this often: rewarded sessions are written as a shard, new published weights are loaded
    duration_min: Optional[float] = None  # stop after this long (None: until cancelled or the job's time limit)


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron's parallel linears (lora.py)


@dataclass
class LoRAConfig:
    """Low-rank adapters on Megatron's parallel linear layers (rft/trainer/lora.py); per stage."""

    rank: int = 0  # adapter rank (0: off, every weight trains)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class TrainerConfig:
    max_steps: int = MISSING  # optimizer steps in this stage
    micro_batch_size: int = 8  # sequences per forward/backward (padded), unless the token budget below is set
    max_tokens_per_microbatch: int = 0  # >0: rows packed (no padding) up to this many tokens per forward/backward
    skip_zero_advantage_rows: bool = True  # rows with advantage 0 everywhere skip the forward when only the policy loss sees them
    tensor_parallel_size: int = 1  # Megatron TP
    pipeline_parallel_size: int = 1  # Megatron PP: stages run Megatron's 1F1B schedule (rft/trainer/pipeline.py)
    virtual_pipeline_stages: int = 1  # >1 (with PP >= 2): model chunks per stage, Megatron's interleaved 1F1B
    sft_batch_size: int = 32  # dataset stages: rows per SFT step, preference pairs per DPO step
    threads: int = 0  # torch CPU threads per rank (0: all cores, half with sync.offset > 0: roles overlap)
    save_interval: int = 0  # also checkpoint every N global steps (0: by time and on Slurm's time-limit signal only)
    save_every_min: float = 30.0  # checkpoint when this many minutes passed since the last one (0: off)
    save_hf: bool = False  # with each checkpoint also an HF export (<run>/checkpoints/hf/v<step>; mode=bench reads it)
    keep_checkpoints: int = 2  # complete checkpoints kept in <output dir>/checkpoints
    loss_scale: Optional[float] = None  # constant loss scale (None: dynamic with fp16 parameters, 1 otherwise)
    distributed_optimizer: bool = True  # CUDA: shard fp32 masters and AdamW state over DP ranks (Megatron's)
    recompute: str = "none"  # none | selective (core attention) | full (every layer): activations redone in backward
    sequence_parallel: bool = False  # with TP > 1: norms and residuals hold 1/TP of the sequence each (Megatron's SP)
    transformer_impl: str = "auto"  # auto (Transformer Engine on GPUs where it imports, without LoRA) | local | transformer_engine
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: only adapters train, merged at the stage end


@dataclass
class BufferConfig:
    format: str = "parquet"  # parquet | arrow
    lease_s: float = 600.0  # a claimed shard not committed within this returns to the pool
    wait_timeout_s: float = 1800.0  # trainer gives up waiting for experience after this
    poll_s: float = 0.002  # how often the trainer looks for a new shard (one directory listing)
    max_staleness: Optional[int] = None  # a shard whose weights are more trainer steps old is stale (None: no limit)
    stale: str = "drop"  # drop: skip its step, keep it as <name>.stale | reweight: train it with truncated IS
    operators: list[Any] = field(default_factory=list)  # experience operators between workflow and buffer (rft/buffer/operators.py)
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # experience trained on again (rft/buffer/replay.py)


@dataclass
class SyncConfig:
    interval: int = 1  # rollout stages: trainer steps between weight syncs (rft/schedule.py)
    offset: int = 0  # rollout stages: explorer steps ahead of the trainer (0: take turns, 1: one-step-off)
    engine: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo | checkpoint
    bucket_mb: int = 512  # weight-transfer bucket size; two are in flight (double buffering)
    wire_dtype: str = "auto"  # dtype on the wire: auto (bfloat16 on GPU, model.dtype on CPU) | a dtype
    checkpoint_dir: Optional[str] = None  # checkpoint engine: where versions go (default: <run>/weights)
    timeout_s: float = 600.0  # a collective that takes longer fails, naming the peer
    lora: str = "merged"  # LoRA stages: merged (W + B A, every weight) | adapter (A and B only, vLLM's LoRA)


@dataclass
class ClusterConfig:
    kind: str = "auto"  # auto (slurm if sbatch is on PATH and the controller answers) | local | slurm
    trainer_ranks: int = 1  # ranks [0, T) train
    rollout_ranks: int = 1  # ranks [T, T+R) generate
    judge_ranks: int = 0  # ranks [T+R, T+R+J) serve frozen judge engines (rft/explorer/judge.py; 0: none)
    timeout_min: int = 240  # wall-clock limit of the job
    master_port: int = 0  # rendezvous port (0: local: a free one; slurm: derived from the job id)
    wait: bool = False  # slurm: follow the job to its end and exit with its status (local always waits)
    partition: Optional[str] = None  # slurm partition (checked with sinfo before submit)
    account: Optional[str] = None  # slurm account to charge
    qos: Optional[str] = None  # slurm quality of service
    constraint: Optional[str] = None  # slurm node features, e.g. "a100&ib"
    nodes: int = 1  # nodes in the allocation
    gpus_per_node: Optional[int] = None  # GPUs per node, one task each; 0: CPU nodes; None: one per rank if sinfo lists GPUs
    cpus_per_task: int = 1  # CPU cores per task
    mem_gb: Optional[int] = None  # memory per node (None: the partition's default)
    setup: list[str] = field(default_factory=list)  # shell lines run before the ranks start (module load ...)
    sbatch_extra: dict[str, Any] = field(default_factory=dict)  # any other sbatch option, e.g. {reservation: x}
    container_image: Optional[str] = None  # Apptainer image the ranks run in (launch/rank.sh)
    container_binds: list[str] = field(default_factory=list)  # paths bound into the container
    env: dict[str, str] = field(default_factory=dict)  # exported for every rank, e.g. NCCL_IB_HCA
    max_requeues: int = 3  # times a job stopped by the time-limit signal requeues itself
    signal_delay_s: int = 120  # Slurm sends SIGUSR2 this long before the time limit: save, requeue


@dataclass
class MonitorConfig:
    eval_interval: int = 0  # eval every N steps (0: only at stage start and end)
    progress: bool = True  # live progress bar in the launcher


@dataclass
class StageConfig:
    """One stage of a multi-stage run: a name plus overrides of the top-level sections."""

    name: str = MISSING  # stage name (TensorBoard prefix-free; summary row)
    # empty rather than None, so `+stages.1.data.selector.name=difficulty` can add to a stage's section
    algorithm: dict[str, Any] = field(default_factory=dict)  # overrides of `algorithm`
    trainer: dict[str, Any] = field(default_factory=dict)  # overrides of `trainer`
    rollout: dict[str, Any] = field(default_factory=dict)  # overrides of `rollout`
    data: dict[str, Any] = field(default_factory=dict)  # overrides of `data`


@dataclass
class RunConfig:
    name: str = "run"  # run name (output folder name)
    output_dir: str = MISSING  # where logs, buffer, checkpoints and TensorBoard files go
    resume: str = "auto"  # auto: from the newest complete checkpoint, else start over | require | never (rft/runtime/run_dir.py)


@dataclass
class BenchConfig:
    checkpoints: list[str] = field(default_factory=list)  # HF model directories to evaluate, in order
    run_dir: Optional[str] = None  # also every HF export of this run (<run>/checkpoints/hf/v*, trainer.save_hf)
    k: list[int] = field(default_factory=lambda: [1, 4])  # pass@k and mean@k for these k (n = max k samples)
    temperature: float = 1.0  # sampling temperature of the bench samples


@dataclass
class RFTConfig:
    mode: str = "both"  # both: explore + train | train: offline (SFT, DPO) | explore: rollouts only | serve: the OpenAI endpoint only | bench
    seed: int = 0  # seeds data order, sampling and init on every rank
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    stages: list[StageConfig] = field(default_factory=list)  # empty: one stage from the top level


def field_doc(key: str) -> Optional[str]:
    """The one-line doc of a config key such as `model.path`, read from the comment beside its
    field in this module (so error messages and the fields stay in one place)."""
    import inspect
    import re
    import typing

    cls: Any = RFTConfig
    parts = key.split(".")
    for part in parts[:-1]:
        hint = typing.get_type_hints(cls).get(part)
        args = [a for a in typing.get_args(hint) if a is not type(None)]  # Optional[X] -> X
        cls = args[0] if args else hint
        if not isinstance(cls, type):
            return None
    try:
        source = inspect.getsource(cls)
    except (TypeError, OSError):
        return None
    found = re.search(rf"^\s+{re.escape(parts[-1])}:[^#\n]*#\s*(.+)$", source, re.M)
    return found.group(1).strip() if found else None


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can use it as its base (`- rft_schema`)."""
    ConfigStore.instance().store(name="rft_schema", node=RFTConfig)


def adapter_sync(stage: RFTConfig) -> bool:
    """A LoRA stage whose syncs send the adapters to vLLM's LoRA support (sync.lora=adapter)."""
    return stage.trainer.lora.rank > 0 and stage.sync.lora == "adapter"


def trains_lora(cfg: RFTConfig) -> bool:
    """Some stage trains LoRA adapters (the trainer's model then needs the local layer spec)."""
    return any(s.trainer.lora.rank > 0 for _, s in stage_configs(cfg))


def vllm_lora_rank(cfg: RFTConfig) -> int:
    """The max_lora_rank vLLM's engines start with: the largest adapter-synced stage's rank rounded
    up to a rank vLLM supports (0: LoRA off in vLLM)."""
    ranks = [s.trainer.lora.rank for _, s in stage_configs(cfg) if adapter_sync(s)]
    return next((r for r in VLLM_LORA_RANKS if r >= max(ranks)), 0) if ranks else 0


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def stage_configs(cfg: RFTConfig) -> list[tuple[str, RFTConfig]]:
    """Resolve `stages:` into one full config per stage; overrides go through the typed schema."""
    if not cfg.stages:
        return [("main", cfg)]
    base = OmegaConf.structured(cfg)
    base.stages = []
    resolved = []
    for index, stage in enumerate(cfg.stages):
        merged = base
        for section in ("algorithm", "trainer", "rollout", "data"):
            override = getattr(stage, section)
            if override:
                try:
                    merged = OmegaConf.merge(merged, {section: override})
                except Exception as err:  # omegaconf raises ConfigKeyError / ValidationError
                    raise ValueError(
                        f"stages[{index}] ({stage.name}).{section}: {err}. "
                        f"Use keys that exist under `{section}` (see rft/config.py)."
                    ) from None
        resolved.append((stage.name, OmegaConf.to_object(merged)))
    return resolved


def config_error(key: str, value: Any, fix: str) -> None:
    """Raise the ValueError every config check uses: the key, its value, and how to fix it."""
    raise ValueError(f"{key}={value!r} is invalid: {fix}")


def hf_config_json(model: ModelConfig) -> Optional[dict[str, Any]]:
    """The model's config.json as a dict (the tiny model's from its settings), without loading it."""
    if model.tiny is not None:
        t = model.tiny
        return {"num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
                "num_hidden_layers": t.num_layers, "max_position_embeddings": t.max_position_embeddings}
    path = os.path.join(model.path, "config.json")
    if not os.path.isfile(path):
        return None
    import json

    with open(path) as f:
        return json.load(f)


def context_length(model: ModelConfig) -> int:
    """Tokens of prompt + response rft gives the model: `model.max_seq_len`, capped by the model's
    max_position_embeddings. vLLM's max_model_len; every taskset row is fitted into it
    (rft/data/context_fit.py), so a trainer microbatch holds at most micro_batch_size x this."""
    hf = hf_config_json(model) or {}
    return min(model.max_seq_len, hf.get("max_position_embeddings") or model.max_seq_len)


def generated_data(cfg: RFTConfig) -> list[RFTConfig]:
    """The configs whose data sections the launcher writes before launch (rft.launch.prepare): the
    top level's if it sets data.arithmetic or data.from_env, and each stage's that sets one of
    them itself. A stage that only inherits the top level's generator reads its own files: they
    are the user's, never overwritten."""
    sections = [cfg] if cfg.data.arithmetic is not None or cfg.data.from_env is not None else []
    for stage, (_, resolved) in zip(cfg.stages, stage_configs(cfg) if cfg.stages else []):
        if stage.data and ("arithmetic" in stage.data or "from_env" in stage.data):
            sections.append(resolved)
    return sections


def world_size(cfg: RFTConfig) -> int:
    """Tasks the job runs: trainer + rollout + judge ranks; only trainer ranks for mode=train, no
    trainer ranks for mode=explore; one for mode=bench."""
    if cfg.mode == "bench":
        return 1
    if cfg.mode == "train":
        return cfg.cluster.trainer_ranks
    if cfg.mode == "serve":
        return cfg.cluster.rollout_ranks
    trainers = 0 if cfg.mode == "explore" else cfg.cluster.trainer_ranks
    return trainers + cfg.cluster.rollout_ranks + cfg.cluster.judge_ranks


def judge_span(cfg: RFTConfig) -> int:
    """Tasks one judge engine spans: its TP size on GPU nodes (a task per GPU), else 1."""
    return cfg.judge.tensor_parallel_size if cfg.cluster.gpus_per_node else 1


def sync_engine(sync: SyncConfig, on_gpu: bool) -> str:
    """The weight-transfer engine `sync.engine=auto` resolves to on this hardware."""
    return sync.engine if sync.engine != "auto" else ("nccl" if on_gpu else "gloo")


def wire_dtype(cfg: RFTConfig, on_gpu: bool) -> str:
    """The dtype weights travel in: bfloat16 on GPUs by default, the model's dtype on CPU."""
    return cfg.sync.wire_dtype if cfg.sync.wire_dtype != "auto" else ("bfloat16" if on_gpu else cfg.model.dtype)


def needs_rollouts(stage: RFTConfig) -> bool:
    """Whether a stage learns from the explorer's rollouts (else it trains from a dataset)."""
    return stage.algorithm.policy_loss not in ("sft", "dpo")


def needs_critic(stage: RFTConfig) -> bool:
    """Whether a stage trains a critic: GAE on rollouts. A dataset stage (sft, dpo) never does, even
    when it inherits advantage=gae from a top-level `algorithm=ppo`: it computes no advantages."""
    return needs_rollouts(stage) and stage.algorithm.advantage == "gae"
