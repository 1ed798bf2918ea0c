"""The rollout rank: stages of (generate + score -> write experience) -> receive new weights.

    for each stage:
        evaluate (stage start)
        for each step e:
            if the stage learns from rollouts (GRPO):
                rows = workflow(engine, cursor.next_batch())  # vLLM, reward
                buffer.write(rows, version=engine.version)
            for each trainer step t paired with e:            # rft/schedule.py (sync.offset)
                vote at t's control point (stop? checkpoint?)
                engine.receive_weights() if the trainer publishes after t
        evaluate (stage end)
"""

from __future__ import annotations

import os
import time

import torch

from rft.algorithms.filters import SAMPLE_FILTERS
from rft.buffer.shards import ExperienceBuffer
from rft.buffer.context_fit import ContextFit
from rft.buffer.taskset import TaskCursor, read_stage_tasks, row_scalars
from rft.checkpoint import Resume, SaveClock, save_rank_state
from rft.cluster import RankInfo, engine_span, sync_layout
from rft.config import RFTConfig, context_length, needs_rollouts, stage_configs
from rft.explorer.rewards import RewardScorer
from rft.explorer.vllm_engine import RolloutEngine
from rft.explorer.workflow import evaluate, run_filtered, run_single_turn
from rft.monitor import (Monitor, append_jsonl, drop_from_step, eval_path, peak_rss_gb, rank_summary_path,
                         write_json_atomic)
from rft.preemption import ControlGroup, StopFlag, requeue_or_stop
from rft.schedule import is_eval_step, paired_trainer_steps, publishes_after


def run_explorer(cfg: RFTConfig, info: RankInfo, control: ControlGroup, stop: StopFlag,
                 resume: Resume | None) -> dict:
    """Explore every stage; with `resume`, start at its pending sync (rft/checkpoint.py)."""
    run_dir = cfg.run.output_dir
    t_start = time.time()
    stop.ignore_in_children()  # vLLM's worker processes must survive Slurm's SIGUSR2
    engine = RolloutEngine(cfg.model, cfg.rollout, cfg.seed + info.rank, context_length(cfg.model))
    stop.install()
    startup_s = time.time() - t_start  # overlaps the trainer's first steps
    saved = resume.load(info.rank) if resume else None
    # with sync.offset this rank saved ahead of the trainer: its own step is where it resumes
    resumed_at = saved["global_step"] if saved else None
    monitor = Monitor(run_dir, f"rollout{info.rank}", resumed_at)
    if saved:
        drop_from_step(eval_path(run_dir), resumed_at)
    buffer = ExperienceBuffer(os.path.join(run_dir, "buffer"), cfg.buffer.format, cfg.buffer.lease_s)
    global_step, joined = (saved["global_step"], False) if saved else (0, False)
    totals = {"rollout_s": 0.0, "buffer_s": 0.0, "sync_wait_s": 0.0, "eval_s": 0.0, "startup_s": 0.0}
    row_counts: dict[str, dict[str, int]] = {}  # per taskset: rows skipped (malformed, overlong), truncated
    reward_errors, prior_wall_s = 0, 0.0
    if saved:
        totals, row_counts, reward_errors = saved["totals"], saved["skipped"], saved["reward_errors"]
        prior_wall_s, engine.version = saved["wall_s"], saved["version"]
    totals["startup_s"] += startup_s
    save_clock = SaveClock(cfg.trainer.save_every_min)
    for stage_index, (stage_name, stage) in enumerate(stage_configs(cfg)):
        if saved and stage_index < saved["stage_index"]:
            continue
        algo, rollout, data = stage.algorithm, stage.rollout, stage.data
        eval_scorer = RewardScorer(algo.reward, rollout.reward_timeout_s)
        scorer = RewardScorer(algo.reward, rollout.reward_timeout_s)
        fit = ContextFit(engine.tokenizer, cfg.model.chat_template, context_length(cfg.model), data.overlong)
        eval_tasks = []
        if data.eval_path:
            eval_tasks = fit.for_rollouts(read_stage_tasks(data.eval_path, data, row_counts), data.eval_path,
                                          rollout.max_new_tokens, row_counts)[: data.eval_limit]

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
            tasks = fit.for_rollouts(read_stage_tasks(data.train_path, data, row_counts), data.train_path,
                                     rollout.max_new_tokens, row_counts)
            cursor = TaskCursor(tasks, cfg.seed + stage_index)
        first_step, pending, voted = 0, None, None
        stage_start = global_step  # global steps done before this stage (the same count for the trainer)
        if saved and stage_index == saved["stage_index"]:
            if cursor is not None:
                cursor.load_state_dict(saved["cursor"])
            first_step, pending, voted = saved["step"], saved["scalars"], saved.get("voted", saved["step"])
            stage_start = saved["global_step"] - saved["step"] - 1
            saved = None
        else:
            stage_files = [data.eval_path] + ([data.train_path] if cursor else [])
            monitor.log(global_step, row_scalars(row_counts, stage_files), stage_name)
            run_eval("start")
        for step in range(first_step, stage.trainer.max_steps):
            if pending is not None:  # resumed: this step's experience was written before the checkpoint
                scalars, pending = pending, None
            else:
                scalars = {}
                if cursor is not None:
                    t0 = time.time()

                    def generate(num_tasks: int, round_index: int) -> dict[str, list]:
                        return run_single_turn(engine, cursor.next_batch(num_tasks), algo.group_size, scorer,
                                               rollout.max_new_tokens, rollout.temperature, rollout.top_p,
                                               list(rollout.stop),
                                               cfg.seed * 10**9 + global_step * 10**5 + round_index * 10**4,
                                               cfg.model.chat_template)

                    rows, filter_stats = run_filtered(generate, SAMPLE_FILTERS.resolve(algo.sample_filter),
                                                      rollout.tasks_per_step, algo.group_size,
                                                      rollout.max_sampling_rounds)
                    t1 = time.time()
                    buffer.write(rows, step=global_step, producer=info.rank, version=engine.version)
                    t2 = time.time()
                    generated = sum(len(r) for r in rows["response_ids"])
                    totals["rollout_s"] += t1 - t0
                    totals["buffer_s"] += t2 - t1
                    scalars = {"timing/rollout_s": t1 - t0, "timing/buffer_write_s": t2 - t1,
                               "perf/tokens_per_s": generated / max(t1 - t0, 1e-9),
                               "rollout/reward_errors": scorer.errors + scorer.timeouts, **filter_stats}
                global_step += 1
            t3 = time.time()
            for t in paired_trainer_steps(cfg, stage, step):
                if voted is not None and t <= voted:  # resumed: voted (and saved) before the checkpoint
                    if t < voted:
                        continue
                else:
                    # the control point, in step with the trainer's step t (rft/preemption.py)
                    stopping, save_due = control.vote(stop.requested, save_clock.due())
                    done = stage_start + t + 1  # the trainer's global steps: what the checkpoint is named by
                    if stopping or save_due or (cfg.trainer.save_interval and done % cfg.trainer.save_interval == 0):
                        save_rank_state(run_dir, done, info.rank, {
                            "global_step": global_step, "stage_index": stage_index, "step": step, "voted": t,
                            "cursor": cursor.state_dict() if cursor else None, "version": engine.version,
                            "scalars": scalars, "totals": totals, "skipped": row_counts,
                            "reward_errors": reward_errors + scorer.errors + scorer.timeouts
                            + eval_scorer.errors + eval_scorer.timeouts,
                            "wall_s": prior_wall_s + time.time() - t_start})
                        control.any(False)  # every rank's file is written: the checkpoint is complete
                        save_clock.saved()
                        if stopping:
                            monitor.close()
                            requeue_or_stop(control, stop, run_dir, done, cfg.cluster.max_requeues)
                if publishes_after(cfg, stage, stage_start, t, resumed=t == voted):
                    if not joined:  # the trainer opens the groups at its first sync, not before
                        engine.open_weight_receiver(sync_layout(cfg, info, torch.cuda.is_available()),
                                                    info.role_rank // engine_span(cfg)
                                                    * cfg.rollout.tensor_parallel_size)
                        joined = True
                    scalars["timing/weight_apply_s"] = engine.receive_weights()
            voted = None
            totals["sync_wait_s"] += time.time() - t3
            if scalars:
                monitor.log(global_step, scalars, stage_name)
            if is_eval_step(cfg, global_step, step, stage.trainer.max_steps):
                run_eval("interval")
        run_eval("end")
        reward_errors += scorer.errors + scorer.timeouts + eval_scorer.errors + eval_scorer.timeouts
        scorer.close()
        eval_scorer.close()
    monitor.close()
    summary = {"role": "rollout", "rank": info.rank, "steps": global_step, "version": engine.version,
               "wall_s": prior_wall_s + time.time() - t_start, "skipped_rows": row_counts,
               "reward_errors": reward_errors, "peak_rss_gb": peak_rss_gb(), **totals}
    write_json_atomic(rank_summary_path(run_dir, info.rank), summary)
    return summary
