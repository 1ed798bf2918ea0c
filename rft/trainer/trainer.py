"""The trainer rank: stages of (read experience or SFT data) -> train step -> publish weights.

    for each stage:
        for each step:
            batch  = buffer.claim(step)          # GRPO: experience from the explorer
                     or sft_cursor.next_batch()  # SFT: reference answers
            train_step(model, optimizer, batch)
            send weights (version = step count)  # the explorer blocks on this
"""

from __future__ import annotations

import os
import time

import torch

from rft.algorithms.grpo import group_advantages
from rft.buffer.shards import ExperienceBuffer
from rft.buffer.taskset import TaskCursor, read_taskset
from rft.cluster import RankInfo
from rft.config import RFTConfig, needs_rollouts, stage_configs, syncs_after_step
from rft.explorer.prompts import format_prompt, reference_response
from rft.monitor import Monitor, progress_path, rank_summary_path, write_json_atomic
from rft.trainer.model import build_gpt_model, export_hf_weights, init_model_parallel, load_hf_state, load_hf_weights
from rft.trainer.train_step import StepBatch, train_step
from rft.weights.group import open_weight_group
from rft.weights.transfer import send_weights


def _experience_batch(table, algo) -> tuple[StepBatch, dict[str, float]]:
    rewards = torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32)
    advantages = group_advantages(rewards, algo.group_size, algo.norm_adv_by_std)
    responses = table.column("response_ids").to_pylist()
    batch = StepBatch(prompt_ids=table.column("prompt_ids").to_pylist(), response_ids=responses,
                      advantages=advantages.tolist(),
                      old_logprobs=table.column("response_logprobs").to_pylist())
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    stats = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
             "response_length/mean": float(lengths.mean())}
    return batch, stats


def _sft_batch(cursor: TaskCursor, n: int, tokenizer, chat_template: bool) -> StepBatch:
    tasks = cursor.next_batch(n)
    prompts = [tokenizer(format_prompt(t, tokenizer, chat_template), add_special_tokens=False).input_ids
               for t in tasks]
    return StepBatch(prompt_ids=prompts, response_ids=[reference_response(t.answer, tokenizer) for t in tasks])


def run_trainer(cfg: RFTConfig, info: RankInfo) -> dict:
    from transformers import AutoTokenizer

    run_dir = cfg.run.output_dir
    torch.manual_seed(cfg.seed)
    init_model_parallel(cfg.trainer.tensor_parallel_size, cfg.seed)
    model, geo = build_gpt_model(cfg.model.path, cfg.model.dtype)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    is_sender = info.rank == 0
    group = None  # opened at the first sync, so training overlaps the rollout engine's start-up
    monitor = Monitor(run_dir, f"trainer{info.rank}") if is_sender else None
    buffer = ExperienceBuffer(os.path.join(run_dir, "buffer"), cfg.buffer.format, cfg.buffer.lease_s)
    wire_dtype = getattr(torch, cfg.model.dtype)
    stages = stage_configs(cfg)
    total_steps = sum(s.trainer.max_steps for _, s in stages)
    global_step, version = 0, 0
    totals = {"train_s": 0.0, "sync_s": 0.0, "buffer_s": 0.0, "wait_s": 0.0}
    run_start = time.time()
    for stage_index, (stage_name, stage) in enumerate(stages):
        algo = stage.algorithm
        optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay,
                                      betas=(0.9, 0.99))
        warmup = max(algo.warmup_steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        ref_model = None
        if algo.name == "grpo" and algo.kl_coef > 0:
            # frozen reference: the policy at stage start (Megatron modules hold process groups,
            # so build a twin and copy the weights rather than deepcopy)
            ref_model, _ = build_gpt_model(cfg.model.path, cfg.model.dtype)
            ref_model.load_state_dict(model.state_dict())
            ref_model.eval().requires_grad_(False)
        cursor = None
        if algo.name == "sft":
            tasks, _ = read_taskset(stage.data.train_path, stage.data.prompt_key, stage.data.answer_key,
                                    stage.data.prompt_template)
            cursor = TaskCursor(tasks, cfg.seed + stage_index)
        step_start = time.time()
        for step in range(stage.trainer.max_steps):
            scalars: dict[str, float] = {}
            if needs_rollouts(stage):
                t0 = time.time()
                claim = buffer.claim(consumer=info.rank, timeout_s=cfg.buffer.wait_timeout_s)
                t1 = time.time()
                batch, scalars = _experience_batch(claim.table, algo)
                produced_by = int(claim.table.column("version")[0].as_py())
                scalars["policy/version_lag"] = version - produced_by
                scalars["timing/wait_s"] = claim.waited_s
                scalars["timing/buffer_read_s"] = (t1 - t0) - claim.waited_s
                totals["wait_s"] += claim.waited_s
                totals["buffer_s"] += (t1 - t0) - claim.waited_s
            else:
                batch = _sft_batch(cursor, stage.trainer.sft_batch_size, tokenizer, cfg.model.chat_template)
            t2 = time.time()
            metrics = train_step(model, optimizer, batch, algo, stage.trainer.micro_batch_size, pad_id, ref_model)
            scheduler.step()
            t3 = time.time()
            if needs_rollouts(stage):
                buffer.commit(claim)
            t4 = time.time()
            if needs_rollouts(stage):
                scalars["timing/buffer_read_s"] += t4 - t3  # the commit rename
            sent = 0
            if syncs_after_step(cfg, stage, global_step + 1, step):
                version += 1
                if is_sender:
                    if group is None:
                        group = open_weight_group(info.master_addr, info.weight_port, 0,
                                                  1 + info.rollout_ranks, cfg.sync.timeout_s,
                                                  info.weight_peer_names())
                    sent = send_weights(group, export_hf_weights(model, geo), version,
                                        cfg.sync.bucket_mb << 20, wire_dtype)
                else:  # other TP ranks take part in the gather
                    for _ in export_hf_weights(model, geo):
                        pass
            t5 = time.time()
            global_step += 1
            totals["train_s"] += t3 - t2
            totals["buffer_s"] += t4 - t3
            totals["sync_s"] += t5 - t4
            if is_sender:
                step_s = t5 - step_start
                scalars.update(metrics)
                scalars.update({"timing/train_s": t3 - t2, "timing/step_s": step_s,
                                "perf/train_tokens_per_s": metrics["train/tokens"] / max(t3 - t2, 1e-9),
                                "actor/lr": scheduler.get_last_lr()[0]})
                if sent:
                    scalars.update({"timing/sync_s": t5 - t4, "perf/sync_gbps": sent / max(t5 - t4, 1e-9) / 1e9})
                monitor.log(global_step, scalars, stage_name)
                write_json_atomic(progress_path(run_dir), {
                    "stage": stage_name, "stage_index": stage_index, "num_stages": len(stages),
                    "step": global_step, "total_steps": total_steps, "time": time.time(),
                    "start": run_start, "reward": scalars.get("reward/mean"),
                    "loss": scalars.get("loss/policy")})
            step_start = time.time()
    summary = {"role": "trainer", "rank": info.rank, "steps": global_step, "wall_s": time.time() - run_start,
               **totals}
    if is_sender:
        monitor.close()
    write_json_atomic(rank_summary_path(run_dir, info.rank), summary)
    return summary
