"""The checks of how a run's roles run (rft/config/checks.py runs them): serve and bench, engines
the run may lose, colocation, free-running exploration, decoupled explorer and trainer jobs."""

from __future__ import annotations

import os

from rft.config.derived import needs_rollouts, stage_configs, sync_engine, vllm_lora_rank
from rft.config.errors import config_error
from rft.config.run import RFTConfig
from rft.weights.hf_dir import run_models


def check_serve(cfg: RFTConfig) -> None:
    if not cfg.serve.step_s > 0:
        config_error("serve.step_s", cfg.serve.step_s, "use a positive number of seconds")
    if cfg.serve.duration_min is not None and not cfg.serve.duration_min > 0:
        config_error("serve.duration_min", cfg.serve.duration_min, "use a positive number of minutes, or null")


def check_engine_failure(cfg: RFTConfig) -> None:
    policy, span = cfg.rollout.on_engine_failure, cfg.rollout.tensor_parallel_size if cfg.cluster.gpus_per_node else 1
    if policy not in ("fail", "continue", "restart"):
        config_error("rollout.on_engine_failure", policy, "use fail (a lost engine ends the job), continue "
                     "(the other engines take its tasks) or restart (the engine is started again)")
    if policy == "restart":
        check_engine_restart(cfg)
    if policy == "continue" and cfg.mode != "both":
        config_error("rollout.on_engine_failure", policy, f"continue needs a trainer to go on with (mode=both); "
                     f"mode={cfg.mode}'s engines host the job's meetings themselves")
    if policy == "continue" and cfg.cluster.rollout_ranks // max(span, 1) < 2:
        config_error("rollout.on_engine_failure", policy, "continue needs two engines or more "
                     f"(cluster.rollout_ranks={cfg.cluster.rollout_ranks} makes one): nothing could go on")
    on_gpu = bool(cfg.cluster.gpus_per_node)
    if policy == "continue" and sync_engine(cfg.sync, on_gpu, cfg.cluster.colocate) == "nccl":
        # a broadcast to an engine that died never completes, and NCCL's watchdog then aborts the
        # sender's process (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING default): the trainer would die with it
        config_error("rollout.on_engine_failure", policy, "continue cannot be honoured over NCCL (sync.engine="
                     f"{cfg.sync.engine} on GPUs): a weight broadcast to an engine that died aborts the trainer's "
                     "process (NCCL's watchdog). Use sync.engine=gloo (a lost engine times out instead; slower) "
                     "or sync.engine=checkpoint, or rollout.on_engine_failure=fail")


def check_engine_restart(cfg: RFTConfig) -> None:
    """rollout.on_engine_failure=restart (rft/explorer/engine_restart.py) restarts an engine inside a
    lockstep run's step: the runs whose engines keep more than their weights, or meet the trainer
    otherwise, are refused rather than restarted wrongly."""
    def refuse(key: str, value, why: str) -> None:
        config_error(key, value, f"rollout.on_engine_failure=restart {why}; use rollout.on_engine_failure=fail "
                                 "or continue there")

    if cfg.rollout.max_engine_restarts < 1:
        config_error("rollout.max_engine_restarts", cfg.rollout.max_engine_restarts, "use 1 or more")
    if not 0 < cfg.rollout.engine_stall_s < cfg.rollout.task_timeout_s:
        # a stalled engine's requests would time out first, and their samples fail, before it is restarted
        config_error("rollout.engine_stall_s", cfg.rollout.engine_stall_s, "use a positive number of seconds below "
                     f"rollout.task_timeout_s ({cfg.rollout.task_timeout_s:g}), above the longest one request takes")
    if cfg.mode != "both":
        refuse("mode", cfg.mode, "restarts an engine between the trainer's weight syncs (mode=both)")
    if cfg.sync.free_run or cfg.sync.decoupled:
        refuse("sync.free_run" if cfg.sync.free_run else "sync.decoupled", True,
               "is made for the lockstep schedule, where every step meets the trainer")
    if cfg.cluster.colocate:
        refuse("cluster.colocate", True, "would start an engine while the trainer holds the GPU it shares")
    if sync_engine(cfg.sync, bool(cfg.cluster.gpus_per_node), cfg.cluster.colocate) == "checkpoint":
        refuse("sync.engine", cfg.sync.engine, "re-forms the weight groups of gloo and nccl only")
    if cfg.sync.lora == "adapter":
        refuse("sync.lora", "adapter", "keeps the base weights a restarted engine loads, not the adapter it serves")
    if cfg.rollout.openai_api:
        refuse("rollout.openai_api", True, "cannot move an agent's open sessions to the new engine")


def check_colocate(cfg: RFTConfig) -> None:
    """Colocated roles (rft/runtime/colocation.py) take turns with the GPUs they share."""
    c, level = cfg.cluster, cfg.rollout.sleep_level
    if level not in (1, 2):
        config_error("rollout.sleep_level", level, "use 1 (weights to host memory, KV cache dropped) or 2 (both dropped)")
    if not c.colocate:
        return
    why = "cluster.colocate=true: "
    if cfg.mode != "both":
        config_error("cluster.colocate", True, why + f"the trainer and the rollout ranks share GPUs; mode={cfg.mode} "
                     "runs one role only: use cluster.colocate=false")
    if cfg.sync.offset != 0:
        config_error("sync.offset", cfg.sync.offset, why + "the roles take turns with the GPUs, so the explorer cannot "
                     "run ahead of the trainer: use sync.offset=0")
    if c.rollout_ranks != c.trainer_ranks:
        config_error("cluster.rollout_ranks", c.rollout_ranks, why + "rollout rank T+i runs on trainer rank i's GPU: "
                     f"use cluster.rollout_ranks={c.trainer_ranks} (cluster.trainer_ranks)")
    if c.judge_ranks:
        config_error("cluster.judge_ranks", c.judge_ranks, why + "judge engines do not sleep; run them disjoint "
                     "(cluster.colocate=false) or use cluster.judge_ranks=0")
    if cfg.rollout.on_engine_failure != "fail":
        config_error("rollout.on_engine_failure", cfg.rollout.on_engine_failure, why + "an engine lost takes its "
                     "trainer rank's GPU with it: use rollout.on_engine_failure=fail")
    if cfg.sync.engine == "nccl":
        config_error("sync.engine", "nccl", why + "NCCL cannot join two processes on one GPU: use sync.engine=auto "
                     "(the checkpoint engine; sync.checkpoint_dir=/dev/shm/... keeps it in node memory)")
    if cfg.sync.lora == "adapter" and vllm_lora_rank(cfg):
        config_error("sync.lora", "adapter", why + "adapters travel over the weight groups, and colocated "
                     "weights through the checkpoint engine: use sync.lora=merged")
    if cfg.rollout.partial_rollout:
        # admit() resumes vLLM's scheduling as the weight load ends (vllm_engine.updating_weights),
        # and colocated, the KV cache wakes only after the load (colocation.EngineSleep.loading): a
        # request queued meanwhile (the OpenAI endpoint) would run on KV memory not yet mapped
        config_error("rollout.partial_rollout", True, why + "a cut request resumes as the weights are loaded, "
                     "before the sleeping engine's KV cache is awake; colocated runs take turns and have nothing "
                     "in flight at a sync anyway: use rollout.partial_rollout=false")
    if level == 2 and cfg.sync.interval > 1:
        # vLLM's level-2 sleep frees the weights, and waking maps new memory without them ("the rest
        # will have empty memory": vllm/device_allocator/cumem.py); only a weight sync fills it
        config_error("rollout.sleep_level", level, why + "level 2 drops the engine's weights at every sleep, and "
                     f"they come back only at a weight sync, every {cfg.sync.interval} steps (sync.interval): in "
                     "between the engine would sample from empty memory. Use sync.interval=1, or "
                     "rollout.sleep_level=1 (weights kept in host memory)")


def check_free_run(cfg: RFTConfig) -> None:
    """A free-running explorer (rft/runtime/free_run.py) is bounded by the staleness limit alone."""
    if not cfg.sync.free_run:
        return
    why = "sync.free_run=true: "
    check_lead(cfg, why)
    if cfg.sync.offset:
        config_error("sync.offset", cfg.sync.offset, why + "the explorer's lead is buffer.max_staleness, not a "
                     "fixed offset: use sync.offset=0")
    if cfg.cluster.colocate:
        config_error("cluster.colocate", True, why + "colocated roles take turns with their GPUs, so neither runs "
                     "free: use one of the two")
    if cfg.rollout.on_engine_failure != "fail":
        config_error("rollout.on_engine_failure", cfg.rollout.on_engine_failure, why + "engines that may be lost "
                     "are not supported yet when running free: use rollout.on_engine_failure=fail")


def check_lead(cfg: RFTConfig, why: str) -> None:
    """An explorer that runs free of the trainer is held back by the staleness bound alone."""
    lead = cfg.buffer.max_staleness
    if lead is None or lead < cfg.sync.interval - 1:
        config_error("buffer.max_staleness", lead, why + "the explorer runs ahead while its shards stay within "
                     f"this many trainer steps of their weights; use {max(1, cfg.sync.interval - 1)} or more "
                     f"(at least sync.interval - 1 = {cfg.sync.interval - 1}, or it would wait for weights "
                     "the trainer never sends)")


def check_decoupled(cfg: RFTConfig) -> None:
    """Decoupled jobs (rft/runtime/decoupled.py) share a buffer and a weights directory only."""
    if not cfg.sync.decoupled:
        return
    why = "sync.decoupled=true: "
    if cfg.mode not in ("explore", "train"):
        config_error("mode", cfg.mode, why + "the explorer and the trainer run as two jobs: launch one with mode=explore "
                     "and one with mode=train, with the same run.output_dir (mode=both runs both in one job)")
    if cfg.sync.engine not in ("auto", "checkpoint"):
        config_error("sync.engine", cfg.sync.engine, why + "the jobs share no process group; weights go through "
                     "sync.checkpoint_dir: use sync.engine=auto")
    for key, value, fix in (("sync.free_run", cfg.sync.free_run, "decoupled exploration runs free already: drop it"),
                            ("sync.offset", cfg.sync.offset, "the explorer's lead is buffer.max_staleness: use 0"),
                            ("cluster.colocate", cfg.cluster.colocate, "two jobs have two allocations: use false"),
                            ("rollout.partial_rollout", cfg.rollout.partial_rollout, "not supported yet between jobs")):
        if value:
            config_error(key, value, why + fix)
    check_lead(cfg, why)
    if cfg.run.resume == "never":
        config_error("run.resume", "never", why + "the two jobs share the run's experience and weights, so one cannot "
                     "start over alone: start a new run in a new run.output_dir instead")
    for name, stage in stage_configs(cfg):
        if not needs_rollouts(stage):
            config_error(f"{f'stages[{name}].' if cfg.stages else ''}algorithm.policy_loss", stage.algorithm.policy_loss,
                         why + "every stage learns from the explorer job's rollouts; run a dataset stage (sft, dpo) "
                         "as a mode=train job of its own first, and start both jobs from its export (model.path)")


def check_bench(cfg: RFTConfig) -> None:
    b = cfg.bench
    if not b.checkpoints and not b.run_dir:
        config_error("bench.checkpoints", list(b.checkpoints), "mode=bench needs checkpoints: bench.run_dir=<a run's "
                     "output dir> (the models it left) or bench.checkpoints=[dir1,dir2] (HF directories)")
    for path in b.checkpoints:
        if not os.path.isdir(path):
            config_error("bench.checkpoints", path, "no such directory (an HF model directory)")
    if b.run_dir and not run_models(b.run_dir):
        config_error("bench.run_dir", b.run_dir, "holds no model: a run leaves one at each stage's end "
                     "(<run>/models/<stage>, trainer.save_model); for one that stopped earlier, convert a "
                     "checkpoint: python -m rft.export <run dir>")
    if not b.k or min(b.k) < 1:
        config_error("bench.k", list(b.k), "use a list of positive k, e.g. [1,4]")
    if cfg.data.eval_path is None:
        config_error("data.eval_path", None, "mode=bench evaluates on the eval taskset; set data.eval_path")
