"""The rollout rank: stages of (generate + score -> write experience) -> receive new weights.

    for each stage:
        evaluate (stage start)
        for each step:
            if the stage learns from rollouts (GRPO):
                rows = workflow(engine, cursor.next_batch())  # vLLM, reward
                buffer.write(rows, version=engine.version)
            engine.receive_weights()                          # trainer's next version
        evaluate (stage end)
"""

from __future__ import annotations

import os
import time

import torch

from rft.buffer.shards import ExperienceBuffer
from rft.buffer.taskset import TaskCursor, read_stage_tasks
from rft.cluster import RankInfo, sync_layout
from rft.config import RFTConfig, is_eval_step, needs_rollouts, stage_configs, syncs_after_step
from rft.explorer.rewards import RewardScorer
from rft.explorer.vllm_engine import RolloutEngine
from rft.explorer.workflow import evaluate, run_single_turn
from rft.monitor import Monitor, append_jsonl, eval_path, rank_summary_path, write_json_atomic


def _max_model_len(cfg: RFTConfig) -> int:
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(cfg.model.path).max_position_embeddings
    return min(limit, 4096)


def run_explorer(cfg: RFTConfig, info: RankInfo) -> dict:
    run_dir = cfg.run.output_dir
    t_start = time.time()
    engine = RolloutEngine(cfg.model, cfg.rollout, cfg.seed + info.rank, _max_model_len(cfg))
    startup_s = time.time() - t_start  # overlaps the trainer's first steps
    monitor = Monitor(run_dir, f"rollout{info.rank}")
    buffer = ExperienceBuffer(os.path.join(run_dir, "buffer"), cfg.buffer.format, cfg.buffer.lease_s)
    global_step, joined = 0, False
    totals = {"rollout_s": 0.0, "buffer_s": 0.0, "sync_wait_s": 0.0, "eval_s": 0.0, "startup_s": startup_s}
    skipped: dict[str, int] = {}
    reward_errors = 0
    for stage_index, (stage_name, stage) in enumerate(stage_configs(cfg)):
        algo, rollout, data = stage.algorithm, stage.rollout, stage.data
        eval_scorer = RewardScorer(algo.reward, rollout.reward_timeout_s)
        scorer = RewardScorer(algo.reward, rollout.reward_timeout_s)
        eval_tasks = read_stage_tasks(data.eval_path, data, skipped)[: data.eval_limit] if data.eval_path else []

        def run_eval(when: str) -> None:
            if not eval_tasks:
                return
            t0 = time.time()
            acc = evaluate(engine, eval_tasks, eval_scorer, rollout.max_new_tokens,
                           rollout.eval_temperature, list(rollout.stop), cfg.seed, cfg.model.chat_template)
            totals["eval_s"] += time.time() - t0
            monitor.log(global_step, {"eval/accuracy": acc}, stage_name)
            append_jsonl(eval_path(run_dir), {"stage": stage_name, "when": when, "step": global_step,
                                              "version": engine.version, "accuracy": acc,
                                              "num_tasks": len(eval_tasks)})

        cursor = None
        if needs_rollouts(stage):
            cursor = TaskCursor(read_stage_tasks(data.train_path, data, skipped), cfg.seed + stage_index)
        run_eval("start")
        for step in range(stage.trainer.max_steps):
            if cursor is not None:
                t0 = time.time()
                rows = run_single_turn(engine, cursor.next_batch(rollout.tasks_per_step), algo.group_size,
                                       scorer, rollout.max_new_tokens, rollout.temperature, rollout.top_p,
                                       list(rollout.stop), cfg.seed * 10**9 + global_step * 10**5,
                                       cfg.model.chat_template)
                t1 = time.time()
                buffer.write(rows, step=global_step, producer=info.rank, version=engine.version)
                t2 = time.time()
                generated = sum(len(r) for r in rows["response_ids"])
                totals["rollout_s"] += t1 - t0
                totals["buffer_s"] += t2 - t1
                monitor.log(global_step + 1, {"timing/rollout_s": t1 - t0, "timing/buffer_write_s": t2 - t1,
                                              "perf/tokens_per_s": generated / max(t1 - t0, 1e-9),
                                              "rollout/reward_errors": scorer.errors + scorer.timeouts},
                            stage_name)
            t3 = time.time()
            if syncs_after_step(cfg, stage, global_step + 1, step):
                if not joined:  # the trainer opens the groups at its first sync, not before
                    engine.open_weight_receiver(sync_layout(cfg, info, torch.cuda.is_available()),
                                                info.role_rank * cfg.rollout.tensor_parallel_size)
                    joined = True
                apply_s = engine.receive_weights()
                monitor.log(global_step + 1, {"timing/weight_apply_s": apply_s}, stage_name)
            totals["sync_wait_s"] += time.time() - t3
            global_step += 1
            if is_eval_step(cfg, global_step, step, stage.trainer.max_steps):
                run_eval("interval")
        run_eval("end")
        reward_errors += scorer.errors + scorer.timeouts + eval_scorer.errors + eval_scorer.timeouts
        scorer.close()
        eval_scorer.close()
    monitor.close()
    summary = {"role": "rollout", "rank": info.rank, "steps": global_step, "version": engine.version,
               "wall_s": time.time() - t_start, "skipped_rows": skipped, "reward_errors": reward_errors,
               **totals}
    write_json_atomic(rank_summary_path(run_dir, info.rank), summary)
    return summary
