"""The trainer rank: stages of (read experience or SFT data) -> train step -> publish weights.

    for each stage:
        for each step:
            batch = experience from the buffer (GRPO)  or  reference answers (SFT)
            train_step(model, optimizer, batch)
            publish weights when the sync schedule says so   # rft/schedule.py
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from rft.buffer.experience import from_table
from rft.buffer.shards import ExperienceBuffer
from rft.buffer.context_fit import ContextFit
from rft.buffer.taskset import TaskCursor, read_stage_tasks, row_scalars
from rft.checkpoint import Resume, SaveClock, prune, save_rank_state, set_rng_state
from rft.cluster import RankInfo, sync_layout
from rft.config import RFTConfig, context_length, needs_critic, needs_rollouts, stage_configs, wire_dtype
from rft.explorer.prompts import format_prompt, reference_response
from rft.monitor import Monitor, peak_rss_gb, progress_path, rank_summary_path, write_json_atomic
from rft.preemption import ControlGroup, StopFlag, requeue_or_stop
from rft.schedule import publishes_after
from rft.trainer.critic import Critic
from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
from rft.trainer.dpo_step import dpo_step
from rft.trainer.train_step import StepBatch, train_step
from rft.weights.convert import export_hf_weights, hf_table, load_hf_weights
from rft.weights.engines import CheckpointSender, make_sender


STALE_TIS_CAP = 2.0  # buffer.stale=reweight's IS cap when algorithm.tis_cap is unset (the TIS paper's C)


def experience_batch(table) -> tuple[StepBatch, dict[str, float]]:
    """A policy-gradient batch (advantages are computed in the step) from a shard's experience
    rows, and reward/length statistics."""
    experiences = from_table(table)
    batch = StepBatch.from_experiences(experiences)
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    lengths = torch.tensor([e.sampled_tokens for e in experiences], dtype=torch.float32)
    stats = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
             "response_length/mean": float(lengths.mean())}
    return batch, stats


def preference_batch(cursor: TaskCursor, n: int, tokenizer, chat_template: bool) -> StepBatch:
    """`n` pairs as rows 2i (prompt + chosen) and 2i+1 (prompt + rejected), for DPO."""
    prompts, responses = [], []
    for t in cursor.next_batch(n):
        prompt = tokenizer(format_prompt(t, tokenizer, chat_template), add_special_tokens=False).input_ids
        prompts += [prompt, prompt]
        responses += [reference_response(t.answer, tokenizer), reference_response(t.rejected, tokenizer)]
    return StepBatch(prompt_ids=prompts, response_ids=responses)


def sft_batch(cursor: TaskCursor, n: int, tokenizer, chat_template: bool) -> StepBatch:
    tasks = cursor.next_batch(n)
    prompts = [tokenizer(format_prompt(t, tokenizer, chat_template), add_special_tokens=False).input_ids
               for t in tasks]
    return StepBatch(prompt_ids=prompts, response_ids=[reference_response(t.answer, tokenizer) for t in tasks])


class ExperienceReader:
    """Trainer rank 0 claims each shard; every trainer rank gets its table (TP/DP split the rows).

    One claim per step, not one per rank: the explorer writes one shard per step.
    """

    def __init__(self, buffer: ExperienceBuffer, info: RankInfo, wait_timeout_s: float, poll_s: float):
        self.buffer, self.info, self.wait_timeout_s, self.poll_s = buffer, info, wait_timeout_s, poll_s
        self.claim = None

    def next_table(self) -> tuple[object, float, float]:
        """(table, seconds waited for the shard to appear, seconds of buffer I/O)."""
        start = time.time()
        payload = [None]
        if self.info.rank == 0:
            self.claim = self.buffer.claim(consumer=0, timeout_s=self.wait_timeout_s, poll_s=self.poll_s)
            payload = [self.claim.table]
        if self.info.trainer_ranks > 1:
            dist.broadcast_object_list(payload, src=0)
        waited = self.claim.waited_s if self.claim else 0.0
        return payload[0], waited, time.time() - start - waited

    def commit(self, stale: bool = False) -> float:
        """Mark the step's shard consumed, or with `stale` set it aside untrained."""
        start = time.time()
        if self.claim is not None:
            (self.buffer.set_aside_stale if stale else self.buffer.commit)(self.claim)
            self.claim = None
        return time.time() - start


class WeightPublisher:
    """Sends HF-named weights to the rollout workers, one sender per pipeline stage.

    DP replica 0's TP ranks of each stage gather in lockstep; the stage's TP rank 0 sends.
    """

    def __init__(self, cfg: RFTConfig, info: RankInfo, geo):
        from megatron.core import parallel_state as ps

        on_gpu = torch.cuda.is_available()
        layout = sync_layout(cfg, info, on_gpu)
        stage = ps.get_pipeline_model_parallel_rank()
        self.geo, self.version = geo, 0
        self.exports = ps.get_data_parallel_rank() == 0
        self.wire = getattr(torch, wire_dtype(cfg, on_gpu))
        self.sender = None
        self.layout, self.stage, self.model_path = layout, stage, cfg.model.path
        if info.rank == layout.sender_ranks[stage]:
            assert self.exports and ps.get_tensor_model_parallel_rank() == 0, "sender layout != Megatron's"
            self.sender = make_sender(layout, stage, cfg.model.path)

    def publish(self, model, version: int) -> int:
        """Send the weights as `version` (trainer steps done); returns payload bytes sent by this rank."""
        self.version = version
        if not self.exports:
            return 0
        tensors = export_hf_weights(model, self.geo)
        if self.sender is None:
            for _ in tensors:  # the TP all-gathers are collectives: every TP rank iterates
                pass
            return 0
        return self.sender.send(hf_table(model, self.geo, self.wire), tensors, self.version)


    def export_hf(self, model, step: int, root: str) -> None:
        """Write the current weights as an HF checkpoint `<root>/v<step>` (the checkpoint engine's
        writer; every export kept): what mode=bench evaluates."""
        if not self.exports:
            return
        tensors = export_hf_weights(model, self.geo)
        if self.sender is None:
            for _ in tensors:  # TP all-gathers: every TP rank iterates
                pass
            return
        writer = CheckpointSender(replace(self.layout, checkpoint_dir=root), self.stage, self.model_path,
                                  keep_versions=None)
        writer.send(hf_table(model, self.geo, self.wire), tensors, step)


def _make_optimizer(model, algo):
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay,
                                  betas=(0.9, 0.99))
    warmup = max(algo.warmup_steps, 1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


def _trainer_state(model, optimizer, scheduler, ref_model, cursor, publisher, position: dict,
                   critic: Critic | None = None) -> dict:
    from rft.checkpoint import rng_state

    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "critic": critic.state_dict() if critic is not None else None,
            "scheduler": scheduler.state_dict(), "ref_model": ref_model.state_dict() if ref_model else None,
            "cursor": cursor.state_dict() if cursor else None, "version": publisher.version,
            "rng": rng_state(), **position}


def run_trainer(cfg: RFTConfig, info: RankInfo, control: ControlGroup, stop: StopFlag,
                resume: Resume | None) -> dict:
    """Train every stage; with `resume`, start at its pending sync (rft/checkpoint.py)."""
    from transformers import AutoTokenizer

    run_dir, run_start = cfg.run.output_dir, time.time()
    torch.manual_seed(cfg.seed)
    init_model_parallel(cfg.trainer.tensor_parallel_size, cfg.seed, cfg.trainer.pipeline_parallel_size)
    model, geo = build_gpt_model(cfg.model.path, cfg.model.dtype)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    saved = resume.load(info.rank) if resume else None
    monitor = Monitor(run_dir, f"trainer{info.rank}", resume.done if resume else None) if info.rank == 0 else None
    reader = ExperienceReader(ExperienceBuffer(os.path.join(run_dir, "buffer"), cfg.buffer.format,
                                               cfg.buffer.lease_s), info, cfg.buffer.wait_timeout_s,
                            cfg.buffer.poll_s)
    publisher = WeightPublisher(cfg, info, geo)
    stages = stage_configs(cfg)
    total_steps = sum(s.trainer.max_steps for _, s in stages)
    global_step = saved["global_step"] if saved else 0
    totals = {"train_s": 0.0, "sync_s": 0.0, "buffer_s": 0.0, "wait_s": 0.0, "stale_dropped": 0, "stale_reweighted": 0}
    totals.update(saved["totals"] if saved else {})
    row_counts: dict[str, dict[str, int]] = saved["skipped"] if saved else {}  # per taskset: rows skipped, truncated
    prior_wall_s = saved["wall_s"] if saved else 0.0
    save_clock = SaveClock(cfg.trainer.save_every_min)
    if saved:
        model.load_state_dict(saved["model"])
        publisher.version = saved["version"]
    for stage_index, (stage_name, stage) in enumerate(stages):
        if saved and stage_index < saved["stage_index"]:
            continue
        algo = stage.algorithm
        optimizer, scheduler = _make_optimizer(model, algo)
        ref_model = None
        is_dpo = algo.policy_loss == "dpo"
        if (needs_rollouts(stage) and algo.kl_coef > 0) or is_dpo:
            # frozen reference: the policy at stage start (Megatron modules hold process groups,
            # so build a twin and copy the weights rather than deepcopy)
            ref_model, _ = build_gpt_model(cfg.model.path, cfg.model.dtype)
            ref_model.load_state_dict(model.state_dict())
            ref_model.eval().requires_grad_(False)
        # PPO's value model, its trunk a copy of the policy at stage start (rft/trainer/critic.py)
        critic = Critic.build(cfg.model.path, cfg.model.dtype, model, algo, cfg.seed) if needs_critic(stage) else None
        cursor, data_scalars = None, {}
        if not needs_rollouts(stage):
            fit = ContextFit(tokenizer, cfg.model.chat_template, context_length(cfg.model), stage.data.overlong)
            path = stage.data.train_path
            tasks = read_stage_tasks(path, stage.data, row_counts, preferences=is_dpo)
            tasks = fit.for_references(tasks, path, row_counts, preferences=is_dpo)
            cursor = TaskCursor(tasks, cfg.seed + stage_index)
            data_scalars = row_scalars(row_counts, [path])  # logged with the stage's first step
        first_step, pending = 0, None
        if saved and stage_index == saved["stage_index"]:
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            if ref_model is not None:
                ref_model.load_state_dict(saved["ref_model"])
            if critic is not None:
                critic.load_state_dict(saved["critic"])
            if cursor is not None:
                cursor.load_state_dict(saved["cursor"])
            set_rng_state(saved["rng"])
            first_step, pending = saved["step"], saved["scalars"]
            saved = None
        step_start = time.time()
        for step in range(first_step, stage.trainer.max_steps):
            resumed = pending is not None
            if resumed:  # this step trained before the checkpoint
                scalars, pending = pending, None
            else:
                scalars, step_algo, drop = {}, algo, False
                if cursor is None:
                    table, waited, io_s = reader.next_table()
                    t1 = time.time()  # preparing the batch counts as training
                    batch, scalars = experience_batch(table)
                    lag = global_step - min(table.column("version").to_pylist())  # trainer steps since its weights
                    scalars["policy/version_lag"] = lag
                    scalars["timing/wait_s"] = waited
                    totals["wait_s"] += waited
                    if cfg.buffer.max_staleness is not None and lag > cfg.buffer.max_staleness:
                        drop = cfg.buffer.stale == "drop"
                        totals[f"stale_{'dropped' if drop else 'reweighted'}"] += 1
                        if not drop:  # off-policy correction against the logprobs vLLM sampled with
                            step_algo = replace(algo, tis_cap=algo.tis_cap or STALE_TIS_CAP)
                    scalars["buffer/stale_dropped"] = totals["stale_dropped"]
                    scalars["buffer/stale_reweighted"] = totals["stale_reweighted"]
                else:
                    t1, io_s = time.time(), 0.0
                    make_batch = preference_batch if is_dpo else sft_batch
                    batch = make_batch(cursor, stage.trainer.sft_batch_size, tokenizer, cfg.model.chat_template)
                if drop:  # the step passes without an update: the schedule (syncs, votes) goes on
                    metrics = {"train/tokens": 0.0}
                elif is_dpo:
                    metrics = dpo_step(model, optimizer, ref_model, batch, algo, stage.trainer.micro_batch_size,
                                       pad_id)
                else:
                    metrics = train_step(model, optimizer, batch, step_algo, stage.trainer.micro_batch_size, pad_id,
                                         ref_model, algo.loss_agg_norm_len or stage.rollout.max_new_tokens,
                                         critic)
                if not drop:
                    scheduler.step()
                t2 = time.time()
                io_s += reader.commit(stale=drop)
                if cursor is None:
                    scalars["timing/buffer_read_s"] = io_s
                global_step += 1
                totals["train_s"] += t2 - t1
                totals["buffer_s"] += io_s
                scalars.update(metrics)
                scalars.update(data_scalars)
                data_scalars = {}
                scalars.update({"timing/train_s": t2 - t1,
                                "perf/train_tokens_per_s": metrics["train/tokens"] / max(t2 - t1, 1e-9),
                                "actor/lr": scheduler.get_last_lr()[0]})
                # the control point: every rank of the job agrees here whether to stop
                stopping, save_due = control.vote(stop.requested, save_clock.due())
                if stopping or save_due or (cfg.trainer.save_interval and global_step % cfg.trainer.save_interval == 0):
                    position = {"global_step": global_step, "stage_index": stage_index, "step": step,
                                "scalars": scalars, "totals": totals, "skipped": row_counts,
                                "wall_s": prior_wall_s + time.time() - run_start}
                    save_rank_state(run_dir, global_step, info.rank,
                                    _trainer_state(model, optimizer, scheduler, ref_model, cursor, publisher,
                                                   position, critic))
                    if cfg.trainer.save_hf:
                        publisher.export_hf(model, global_step, os.path.join(run_dir, "checkpoints", "hf"))
                    control.any(False)  # every rank's file is written: the checkpoint is complete
                    save_clock.saved()
                    if info.rank == 0:
                        prune(run_dir, control.members, cfg.trainer.keep_checkpoints)
                    if stopping:
                        if monitor is not None:
                            monitor.close()
                        requeue_or_stop(control, stop, run_dir, global_step, cfg.cluster.max_requeues)
            t3 = time.time()
            publish = publishes_after(cfg, stage, global_step - step - 1, step, resumed)
            sent = publisher.publish(model, global_step) if publish else 0
            t4 = time.time()
            totals["sync_s"] += t4 - t3
            if monitor is None:
                continue
            scalars["timing/step_s"] = t4 - step_start
            if sent:
                scalars.update({"timing/sync_s": t4 - t3, "perf/sync_gbps": sent / max(t4 - t3, 1e-9) / 1e9})
            monitor.log(global_step, scalars, stage_name)
            write_json_atomic(progress_path(run_dir), {
                "stage": stage_name, "stage_index": stage_index, "num_stages": len(stages),
                "step": global_step, "total_steps": total_steps, "reward": scalars.get("reward/mean")})
            step_start = t4
    if monitor is not None:
        monitor.close()
    summary = {"role": "trainer", "rank": info.rank, "steps": global_step,
               "wall_s": prior_wall_s + time.time() - run_start, "skipped_rows": row_counts,
               "peak_rss_gb": peak_rss_gb(), **totals}
    write_json_atomic(rank_summary_path(run_dir, info.rank), summary)
    return summary
