"""`mode=bench`: evaluate a list of checkpoints on the eval taskset with pass@k and mean@k.

    for each checkpoint (HF directories, and/or the models a run left: its exports, each stage's final model):
        load its weights into one vLLM engine (no restart between checkpoints)
        sample n = max(k) responses per eval task, score them
        pass@k (unbiased estimator, Chen et al. 2021) and mean@k per k
    -> <run>/bench.csv, <run>/bench.md, TensorBoard scalars bench/pass@k, bench/mean@k

Runs as one rollout task; no trainer.
"""

from __future__ import annotations

import csv
import glob
import math
import os
import re

from rft.config import RFTConfig
from rft.weights.hf_dir import run_models

_HF_EXPORT = re.compile(r"v(\d+)$")


def bench_checkpoints(cfg: RFTConfig) -> list[str]:
    paths = list(cfg.bench.checkpoints)
    if cfg.bench.run_dir:
        paths += run_models(cfg.bench.run_dir)
    return paths


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (correct of them right) is right:
    1 - C(n - c, k) / C(n, k), the unbiased estimator of Chen et al. (2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def score_table(rewards: list[list[float]], ks: list[int]) -> dict[str, float]:
    """pass@k and mean@k averaged over tasks; `rewards[t]` holds task t's n >= max(ks) rewards
    (a reward > 0.5 counts as correct for pass@k; mean@k averages the first k rewards)."""
    row = {}
    for k in ks:
        row[f"pass@{k}"] = sum(pass_at_k(len(r), sum(x > 0.5 for x in r), k) for r in rewards) / len(rewards)
        row[f"mean@{k}"] = sum(sum(r[:k]) / k for r in rewards) / len(rewards)
    return row


def write_tables(out_dir: str, rows: list[dict]) -> tuple[str, str]:
    """bench.csv and bench.md (one row per checkpoint)."""
    keys = list(rows[0])
    csv_path, md_path = os.path.join(out_dir, "bench.csv"), os.path.join(out_dir, "bench.md")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    with open(md_path, "w") as f:
        f.write("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n")
        for row in rows:
            f.write("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()) + " |\n")
    return csv_path, md_path


def run_bench(cfg: RFTConfig) -> dict:
    from rft.config import context_length
    from rft.data.context_fit import ContextFit
    from rft.data.stage_tasks import read_stage_tasks
    from rft.explorer.model_client import Sampling
    from rft.explorer.runner import WorkflowRunner
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.explorer.workflows import required_columns
    from rft.runtime.monitor import Monitor, rank_summary_path, write_json_atomic

    paths = bench_checkpoints(cfg)
    if not paths:
        raise ValueError("mode=bench found no checkpoints: set bench.checkpoints=[dir,...] or "
                         "bench.run_dir=<a run with trainer.save_hf=true>")
    ks = sorted(cfg.bench.k)
    row_counts: dict[str, dict[str, int]] = {}
    rollout = cfg.rollout
    engine = RolloutEngine(cfg.model, rollout, cfg.seed, context_length(cfg.model))
    columns = required_columns(rollout.workflow, rollout.env, cfg.algorithm.reward)
    tasks = read_stage_tasks(cfg.data.eval_path, cfg.data, row_counts, required=columns)
    if "prompt" in columns:
        fit = ContextFit(engine.tokenizer, cfg.model.chat_template, context_length(cfg.model), cfg.data.overlong,
                         getattr(engine, "image_processor", None))
        tasks = fit.for_rollouts(tasks, cfg.data.eval_path, rollout.max_new_tokens, row_counts)
    tasks = tasks[: cfg.data.eval_limit]
    runner = WorkflowRunner([engine], rollout, cfg.algorithm.reward, cfg.model.chat_template,
                            os.path.join(cfg.run.output_dir, "failed.jsonl"))
    sampling = Sampling(cfg.bench.temperature, rollout.top_p, rollout.max_new_tokens, tuple(rollout.stop))
    monitor = Monitor(cfg, "bench")
    rows = []
    for index, path in enumerate(paths):
        engine.load_hf_dir(path)
        outcome = runner.run(tasks, max(ks), sampling, (cfg.seed, "bench"), f"bench-{index}", evaluation=True)
        rewards = [[] for _ in tasks]
        for exp in {e.trajectory_id: e for e in outcome.experiences}.values():
            rewards[int(exp.group_id.rsplit(":", 1)[1])].append(float(exp.reward))
        # a sample that failed for good counts as wrong: every task keeps n samples
        rewards = [r + [0.0] * (max(ks) - len(r)) for r in rewards]
        scores = score_table(rewards, ks)
        monitor.log(index, {f"bench/{k}": v for k, v in scores.items()}, "bench")
        rows.append({"checkpoint": path, "tasks": len(tasks), **scores})
        print(f"bench {index + 1}/{len(paths)} {path}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()),
              flush=True)
    runner.close()
    engine.close()
    monitor.close()
    csv_path, md_path = write_tables(cfg.run.output_dir, rows)
    summary = {"role": "bench", "rank": 0, "checkpoints": len(rows), "csv": csv_path, "markdown": md_path,
               "skipped_rows": row_counts}
    write_json_atomic(rank_summary_path(cfg.run.output_dir, 0), summary)
    return summary
