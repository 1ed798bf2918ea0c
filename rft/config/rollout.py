"""The sections of the rollout side: `rollout` (sampling, workflows, engines), `judge` (frozen
engines rewards ask), `serve` (mode=serve) and `bench` (mode=bench)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

CPU_KV_CACHE_GB = 1.0  # an engine's KV cache on CPU when rollout.kv_cache_gb is unset


@dataclass
class RolloutConfig:
    tasks_per_step: int = 16  # tasks per training step (each sampled group_size times)
    max_new_tokens: int = 256  # response length limit
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_p: float = 1.0  # nucleus sampling for training rollouts
    eval_temperature: float = 0.0  # 0: greedy eval
    stop: list[str] = field(default_factory=list)  # extra stop strings
    kv_cache_gb: Optional[float] = None  # KV cache of each engine, GiB (None: 1 GiB of RAM on CPU; on GPUs what rollout.gpu_memory_utilization leaves after the weights)
    gpu_memory_utilization: float = 0.85  # share of GPU memory vLLM may use (GPU only; colocated: leave the trainer room)
    partial_rollout: bool = False  # a weight update cuts requests in flight, which go on with the new weights (each token keeps its version); false: it waits for them
    sleep_level: int = 1  # cluster.colocate: vLLM's sleep while the trainer trains (1: weights to host memory, KV cache dropped; 2: both dropped)
    tensor_parallel_size: int = 1  # vLLM TP per engine
    images_per_prompt: int = 1  # vision-language models: the most images one prompt may hold, a multi-turn trajectory's observations included (vLLM's limit_mm_per_prompt)
    max_num_seqs: int = 256  # vLLM scheduler batch limit
    reward_timeout_s: float = 10.0  # a reward call slower than this scores 0
    max_sampling_rounds: int = 3  # dynamic sampling (algorithm.sample_filter): generation rounds per step
    workflow: str = "single_turn"  # single_turn | multi_turn | step_wise | your workflow: file.py:fn or a dotted path (rft/explorer/workflows/)
    env: Optional[str] = None  # multi_turn/step_wise: grid_world | calculator | a Gymnasium Env class: file.py:Class or a dotted path
    env_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's constructor
    max_turns: int = 8  # multi_turn/step_wise: model turns per episode
    max_concurrent_tasks: int = 256  # trajectories in flight at once (a workflow waiting on a tool holds one)
    task_timeout_s: float = 600.0  # a workflow try running longer is cancelled (and retried)
    max_retries: int = 1  # tries after the first for a sample whose workflow raised or timed out
    openai_api: bool = False  # every engine also serves vLLM's OpenAI API; rewarded sessions join the step's experience
    on_engine_failure: str = "fail"  # fail: a lost engine ends the job, naming it | continue: the other engines take its tasks | restart: a dead or stalled vLLM engine is started again on its rank's devices with the weights it served, and its tasks are dealt again (rft/explorer/engine_restart.py)
    max_engine_restarts: int = 3  # on_engine_failure=restart: restarts each rollout rank may make in a run; one more failure ends the job
    engine_stall_s: float = 300.0  # on_engine_failure=restart: an engine with requests in flight that finishes none for this long is stalled: killed and restarted (keep it above the longest one request takes, and below task_timeout_s)
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
    kv_cache_gb: Optional[float] = None  # KV cache of each judge engine, GiB (None: 1 GiB of RAM on CPU; on GPUs what judge.gpu_memory_utilization leaves after the weights)
    gpu_memory_utilization: float = 0.85  # share of GPU memory a judge engine may use (GPU only)
    max_num_seqs: int = 256  # vLLM scheduler batch limit: concurrent judge calls are batched up to this
    rubric: Optional[str] = None  # relative_judge: the grading standards, as text or the path of a text file (None: the built-in rubric)
    relative_max_new_tokens: int = 1024  # relative_judge: length of the judge's answer (a score and an explanation per answer of the group)
    chat_template: bool = True  # relative_judge asks through the judge model's chat template (judge.chat); false: one plain-text prompt (judge.complete)


@dataclass
class ServeConfig:
    """mode=serve (rft/explorer/serve.py): rollout ranks that only serve the OpenAI endpoint."""

    step_s: float = 10.0  # this often: rewarded sessions are written as a shard, new published weights are loaded
    duration_min: Optional[float] = None  # stop after this long (None: until cancelled or the job's time limit)


@dataclass
class BenchConfig:
    checkpoints: list[str] = field(default_factory=list)  # HF model directories to evaluate, in order
    run_dir: Optional[str] = None  # also the models this run left: its HF exports (<run>/checkpoints/hf/v*), then each stage's (<run>/models/<stage>)
    k: list[int] = field(default_factory=lambda: [1, 4])  # pass@k and mean@k for these k (n = max k samples)
    temperature: float = 1.0  # sampling temperature of the bench samples
