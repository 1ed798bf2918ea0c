"""The trainer rank: take each step's rows, train on them, send the weights to the explorer.

    for each stage:
        for each step:
            colocated: wait until the engines sleep      # rft/runtime/colocation.py (cluster.colocate)
            batch = the step's experience shard (RL)  or  dataset rows (SFT, DPO)
            optimizer step on it                        # rft/trainer/train_step.py
            vote at the step's control point            # stop? checkpoint? (rft/runtime/control.py)
            publish the weights if the schedule says so # rft/runtime/schedule.py; free-running: offered
                                                        # to the explorer, which takes them when it can
        the stage's model as an HF directory            # <run>/models/<stage>, <run>/model (trainer.save_model)
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from rft.algorithms.chord import chord_mu
from rft.buffer.replay import ReplayPool
from rft.buffer.review import ReviewIntake
from rft.buffer.shards import ExperienceBuffer
from rft.config import RFTConfig, adapter_sync, needs_critic, needs_rollouts, operator_specs, trains_lora
from rft.data.context_fit import ContextFit
from rft.data.selectors import build_selector
from rft.data.stage_tasks import read_stage_tasks
from rft.data.taskset import row_scalars
from rft.runtime import faults
from rft.runtime.checkpoint import Resume, prune, rng_state, seed_all, set_rng_state
from rft.runtime.colocation import TrainerTurns
from rft.runtime.control import Runtime, Stage
from rft.runtime.decoupled import explorer_producers
from rft.runtime.membership import lost_ranks, restarts_so_far
from rft.runtime.preemption import ControlGroup, StopFlag
from rft.runtime.topology import Topology
from rft.trainer.batches import DatasetBatches, ExperienceReader, experience_batch
from rft.trainer.critic import Critic
from rft.trainer.dpo_step import dpo_step
from rft.trainer.flops import peak_tflops
from rft.trainer.hf_weights import load_hf_weights
from rft.trainer.layer_spec import check_saved_layers, resolve_transformer_impl, why_these_layers
from rft.trainer.lora import LoRA
from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
from rft.trainer.moe import RouterLoads
from rft.trainer.optimizer import LRSchedule, build_optimizer
from rft.trainer.publisher import WeightPublisher
from rft.trainer.sharded_state import ShardedModel
from rft.trainer.train_step import train_step
from rft.trainer.vision import freeze_vision, image_processor_of
from rft.weights.hf_dir import point_final_model_at, stage_model_dir

STAGE_COMPONENTS = ("lora", "optimizer", "scheduler", "ref_model", "critic", "cursor", "rng")
STALE_TIS_CAP = 2.0  # buffer.stale=reweight's IS cap when algorithm.tis_cap is unset (the TIS paper's C)


def run_trainer(cfg: RFTConfig, topology: Topology, group: ControlGroup, stop: StopFlag, resume: Resume | None) -> dict:
    """Train every stage; with `resume`, start at its pending sync (rft/runtime/checkpoint.py)."""
    started = time.time()
    seed_all(cfg.seed)
    init_model_parallel(cfg.trainer.tensor_parallel_size, cfg.seed, cfg.trainer.pipeline_parallel_size,
                        cfg.trainer.virtual_pipeline_stages, cfg.trainer.expert_parallel_size)
    turns = TrainerTurns(cfg, topology, group.store)  # colocated roles take turns with the GPUs
    turns.wait_started()  # colocated: vLLM sizes its KV cache before the trainer allocates anything
    lora = trains_lora(cfg)
    layers = resolve_transformer_impl(cfg.trainer.transformer_impl, lora)
    if topology.rank == 0 and torch.cuda.is_available():  # which layers a GPU run got, and why
        print(f"rft: trainer layers: {why_these_layers(cfg.trainer.transformer_impl, lora, layers)}", flush=True)
    model, geo = build_gpt_model(cfg.model.path, cfg.model.dtype, recompute=cfg.trainer.recompute,
                                 sequence_parallel=cfg.trainer.sequence_parallel, transformer_impl=layers,
                                 moe_aux_loss_coeff=cfg.trainer.moe_aux_loss_coeff,
                                 logprob_chunk=cfg.trainer.logprob_chunk)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    if cfg.trainer.freeze_vision:
        freeze_vision(model)
    runtime = Runtime(cfg, topology, group, stop, resume, f"trainer{topology.rank}", monitor=topology.rank == 0)
    # startup: model built and weights loaded (tools/bench_startup.py reads it from the rank's summary)
    runtime.progress.add(startup_s=time.time() - started, train_s=0.0, sync_s=0.0, buffer_s=0.0, wait_s=0.0,
                         stale_dropped=0, stale_reweighted=0)
    turns.track(runtime.progress)
    check_saved_layers((runtime.state.saved or {}).get("model"), layers)
    runtime.state.track("model", ShardedModel(model))  # saved layout-free: it may resume into another TP x PP
    publisher = runtime.state.track("publisher", WeightPublisher(cfg, topology, geo))
    add_checkpoint_hooks(cfg, topology, runtime, model, publisher)
    learner = Learner(cfg, topology, model, geo, runtime)
    models: dict[str, str] = {}  # stage name -> its final model directory
    for stage in runtime.stages():
        learner.begin(stage)
        publisher.begin_stage(learner.lora, adapter_sync(stage.cfg))  # a LoRA stage sends W + B A, or A and B
        step_start, unsent = time.time(), True  # a stage's first sync always sends
        for step in stage.steps():
            with turns.training(step.global_step, step.resumed):  # colocated: once the engines sleep
                scalars = step.pending if step.resumed else learner.train(stage)
            # a decoupled explorer learns of a version only from its files: it is written even if unchanged
            unsent = unsent or changed_weights(scalars) or turns.engines_drop_weights or cfg.sync.decoupled
            for point in stage.control_points(step, "trainer"):
                point.meet(scalars, weights_changed=unsent)
                if point.publishes:
                    point.offer()  # free-running: the engines take it at their next step boundary
                if point.publishes and not point.sends_weights:  # the engines hold these weights already
                    publisher.keep(step.global_step)
                    scalars["sync/unchanged"] = 1.0
                elif point.publishes:
                    with runtime.timed("sync_s"), turns.publishing(step.global_step):
                        sync_start, sent = time.time(), publisher.publish(model, step.global_step,
                                                                          present_engines(topology, group),
                                                                          engine_restarts(cfg, group))
                        scalars.update(sync_scalars(sent, time.time() - sync_start))
                    unsent = False
            scalars["timing/step_s"], step_start = time.time() - step_start, time.time()
            runtime.log(stage, step.global_step, scalars)
            if topology.rank == 0:
                runtime.show_progress(stage, step.global_step, scalars)
        learner.end()  # a LoRA stage's adapters are merged into the weights now
        publisher.begin_stage(None, False)
        if stage.cfg.trainer.save_model:
            models[stage.name] = save_stage_model(cfg, topology, runtime, publisher, model, stage)
    lost = lost_ranks(group.store, topology.engine_leaders) if topology.rank == 0 and topology.losable_ranks else {}
    return runtime.finish({"role": "trainer", **({"engines_lost": lost} if lost else {}),
                           **({"models": models} if models and topology.rank == 0 else {})})


def save_stage_model(cfg: RFTConfig, topology: Topology, runtime: Runtime, publisher: WeightPublisher, model,
                     stage: Stage) -> str:
    """The stage's final weights as an HF model directory, <run>/models/<stage>, and <run>/model
    pointed at it: what a finished run leaves for transformers, vLLM and mode=bench."""
    directory = stage_model_dir(cfg.run.output_dir, [name for name, _ in runtime.stage_plan], stage.index)
    publisher.export_model(model, directory)
    if topology.rank == 0:
        point_final_model_at(cfg.run.output_dir, directory)
    return directory


def present_engines(topology: Topology, group: ControlGroup) -> list[int] | None:
    """The engine leaders at the vote before a sync; None (all) unless the run may lose engines."""
    if not topology.losable_ranks:
        return None
    return [r for r in topology.engine_leaders if r in group.present]


def engine_restarts(cfg: RFTConfig, group: ControlGroup) -> int:
    """The job's engine restarts so far (rollout.on_engine_failure=restart), read after the vote
    before a sync as the engines read it: a restart's weight groups are formed anew."""
    return restarts_so_far(group.store) if cfg.rollout.on_engine_failure == "restart" else 0


def changed_weights(scalars: dict[str, float]) -> bool:
    """Whether the step's optimizer moved the policy's weights: not when it took no optimizer step
    (every row without gradient, rft/trainer/train_step.py) or skipped the ones it took (a
    non-finite gradient). Steps that do not say (SFT, DPO) count as changing them."""
    steps = scalars.get("train/optimizer_steps")
    return steps is None or steps - scalars.get("actor/step_skipped", 0.0) > 0


def sync_scalars(sent: int, seconds: float) -> dict[str, float]:
    return {"timing/sync_s": seconds, "perf/sync_gbps": sent / max(seconds, 1e-9) / 1e9,
            "sync/mb": sent / 2**20} if sent else {}


def add_checkpoint_hooks(cfg: RFTConfig, topology: Topology, runtime: Runtime, model, publisher: WeightPublisher) -> None:
    """With each checkpoint: an HF export (trainer.save_hf, what mode=bench reads); once it is
    complete, rank 0 prunes the old ones (trainer.keep_checkpoints)."""
    if cfg.trainer.save_hf:
        root = os.path.join(cfg.run.output_dir, "checkpoints", "hf")
        keep = cfg.trainer.keep_hf_exports or None
        runtime.save_hooks.append(lambda done: publisher.export_hf(model, done, root, keep))
    if topology.rank == 0:
        runtime.saved_hooks.append(lambda done: prune(cfg.run.output_dir, runtime.group.members,
                                                      cfg.trainer.keep_checkpoints))


class RNG:
    """The random number generators as a checkpoint component."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class Learner:
    """What one trainer step does in each stage: its rows, its optimizer step, its statistics."""

    def __init__(self, cfg: RFTConfig, topology: Topology, model, geo, runtime: Runtime):
        from transformers import AutoTokenizer

        self.cfg, self.topology, self.model, self.geo, self.runtime = cfg, topology, model, geo, runtime
        self.lora: LoRA | None = None
        self.router_loads = RouterLoads(model, geo.num_layers, geo.num_experts) if geo.num_experts else None
        weight = next(model.parameters())
        self.peak_tflops = peak_tflops(weight.device, weight.dtype)  # None: no MFU to log (CPU, fp32, unknown GPU)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        buffer = ExperienceBuffer.for_run(cfg)
        producers = topology.engine_leaders if cfg.mode == "both" else None  # each engine writes a shard per step
        if cfg.sync.decoupled:  # the engines of the explorer job beside this one (rft/runtime/decoupled.py)
            producers = explorer_producers(cfg)
        lost = None
        if topology.losable_ranks:  # rollout.on_engine_failure=continue: a lost engine's shards never come
            lost = lambda missing: lost_ranks(runtime.group.store, missing)  # noqa: E731
        self.reader = ExperienceReader(buffer, topology, cfg.buffer.wait_timeout_s, cfg.buffer.poll_s, producers, lost,
                                       *self._reused_sources(buffer))

    def _reused_sources(self, buffer: ExperienceBuffer) -> tuple[ReplayPool | None, ReviewIntake | None]:
        """Rank 0's replay pool (buffer.replay) and review intake (a `review` operator), both run-long
        checkpoint components; log lines of steps a resumed run trains again are dropped."""
        cfg, runtime = self.cfg, self.runtime
        if self.topology.rank != 0 or cfg.mode != "both":
            return None, None
        replay = review = None
        if cfg.buffer.replay.groups_per_step:
            replay = runtime.state.track("replay", ReplayPool(buffer, cfg.buffer.replay, cfg.buffer.max_staleness,
                                                              drop_stale=cfg.buffer.stale == "drop"))
            if runtime.resumed_at is not None:
                replay.resumed_at(runtime.resumed_at + 1)
        if any(name == "review" for name, _ in operator_specs(cfg.buffer.operators)):
            review = runtime.state.track("review", ReviewIntake(cfg.run.output_dir))
        return replay, review

    def begin(self, stage: Stage) -> None:
        """The stage's optimizer, frozen reference, critic and dataset (restored if resumed here)."""
        cfg, algo, track = self.cfg, stage.cfg.algorithm, self.runtime.state.track
        self.runtime.state.untrack(*STAGE_COMPONENTS)  # the previous stage's: not saved again
        self.stage, self.algo = stage, algo
        self.is_dpo = algo.policy_loss == "dpo"
        # the reference is the policy at stage start: built before adapters change what it computes
        self.ref_model = None
        if (needs_rollouts(stage.cfg) and algo.kl_coef > 0) or self.is_dpo:
            # Megatron modules hold process groups, so build a twin and copy the weights rather than deepcopy
            self.ref_model, _ = build_gpt_model(cfg.model.path, cfg.model.dtype,
                                                sequence_parallel=cfg.trainer.sequence_parallel,
                                                transformer_impl=self.model.config.transformer_impl,
                                                logprob_chunk=cfg.trainer.logprob_chunk)
            self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.eval().requires_grad_(False)
            track("ref_model", ShardedModel(self.ref_model), restore=stage.resumed)
        lora = stage.cfg.trainer.lora
        self.lora = None
        if lora.rank:  # only the adapters train (rft/trainer/lora.py)
            self.lora = track("lora", LoRA(self.model, self.geo, lora.rank, lora.alpha, lora.dropout,
                                           lora.target_modules, cfg.seed + stage.index).attach(),
                              restore=stage.resumed)
        # AdamW on fp32 masters whatever model.dtype is (rft/trainer/optimizer.py)
        trained = self.lora if self.lora is not None else self.model
        self.optimizer = track("optimizer", build_optimizer(trained, lr=algo.lr, weight_decay=algo.weight_decay,
                                                            loss_scale=cfg.trainer.loss_scale,
                                                            distributed=cfg.trainer.distributed_optimizer),
                               restore=stage.resumed)
        self.scheduler = track("scheduler", LRSchedule(self.optimizer, algo.lr, algo.warmup_steps, algo.lr_decay,
                                                       stage.cfg.trainer.max_steps, algo.min_lr_ratio),
                               restore=stage.resumed)
        # PPO's value model, its trunk a copy of the policy at stage start (rft/trainer/critic.py)
        self.critic = None
        if needs_critic(stage.cfg):
            self.critic = track("critic", Critic.build(cfg.model.path, cfg.model.dtype, self.model, algo, cfg.seed,
                                                       cfg.trainer.loss_scale, cfg.trainer.distributed_optimizer),
                                restore=stage.resumed)
        self.dataset, self.data_scalars, self.expert = None, {}, None
        if not needs_rollouts(stage.cfg):
            self.dataset = self._dataset(stage)
        elif algo.expert_rows:  # CHORD: demonstrations mixed into each RL step (rft/algorithms/chord.py)
            self.expert = self._dataset(stage, stage.cfg.data.expert_path or stage.cfg.data.train_path, "expert_cursor")
        track("rng", RNG(), restore=stage.resumed)  # last: the stage's set-up above draws no numbers after it

    def end(self) -> None:
        """A LoRA stage's adapters are folded into the weights: the next stage starts from them."""
        if self.lora is not None:
            self.lora.merge()
            self.lora = None

    def _dataset(self, stage: Stage, path: str | None = None, name: str = "cursor") -> DatasetBatches:
        """SFT rows or DPO pairs from `path` (the stage's data.train_path), drawn by a resumable
        cursor tracked under `name`."""
        data, rows, path = stage.cfg.data, self.runtime.progress.rows, path or stage.cfg.data.train_path
        fit = ContextFit(self.tokenizer, self.cfg.model.chat_template, self.topology.context_length, data.overlong,
                         image_processor_of(self.model))
        tasks = read_stage_tasks(path, data, rows, preferences=self.is_dpo, messages_key=data.messages_key,
                                 cleaned_in=(self.cfg.run.output_dir, stage.name) if name == "cursor" else None)
        tasks = fit.for_references(tasks, path, rows, preferences=self.is_dpo, messages_key=data.messages_key)
        cursor = self.runtime.state.track(name, build_selector(tasks, self.cfg.seed + stage.index, data.selector),
                                          restore=stage.resumed)
        self.data_scalars = row_scalars(rows, [path])  # logged with the stage's first step
        return DatasetBatches(cursor, self.tokenizer, self.cfg.model.chat_template, data.messages_key,
                              image_processor_of(self.model))

    def train(self, stage: Stage) -> dict[str, float]:
        """One optimizer step on the step's rows; its scalars."""
        trainer, algo, drop = stage.cfg.trainer, self.algo, False
        start = time.time()
        if self.dataset is None:
            rows = self.reader.next_table(self.runtime.progress.global_step)
            waited, io_s = rows.waited_s, rows.io_s
            start = time.time()  # preparing the batch counts as training
            batch, scalars = experience_batch(rows.table, replay_routes=trainer.routing_replay == "rollout")
            algo, drop = self._staleness(rows, scalars)
            if self.expert is not None:
                batch = batch.with_expert_rows(self.expert.sft(algo.expert_rows), self._chord_mu(stage))
            scalars.update({"timing/wait_s": waited, **rows.scalars})
            if self.reader.corrupt:  # shards quarantined for a bad checksum and written again (or skipped)
                scalars["buffer/corrupt_shards"] = float(self.reader.corrupt)
            if self.reader.producers and len(self.reader.producers) > 1:
                scalars["buffer/engines"] = float(len(self.reader.claims))  # engines whose shards this step trains
            self.runtime.progress.add(wait_s=waited)
        else:
            io_s, scalars = 0.0, {}
            batch = self.dataset.preferences(trainer.sft_batch_size) if self.is_dpo else \
                self.dataset.sft(trainer.sft_batch_size)
        if drop:  # the step passes without an update: the schedule (syncs, votes) goes on
            metrics = {"train/tokens": 0.0}
        elif self.is_dpo:
            metrics = dpo_step(self.model, self.optimizer, self.ref_model, batch, algo, trainer.micro_batch_size,
                               self.pad_id, trainer.max_tokens_per_microbatch)
        else:
            optimizer_steps: list[dict[str, float]] = []
            metrics = train_step(self.model, self.optimizer, batch, algo, trainer.micro_batch_size, self.pad_id,
                                 self.ref_model, algo.loss_agg_norm_len or stage.cfg.rollout.max_new_tokens,
                                 self.critic, optimizer_steps, trainer.max_tokens_per_microbatch,
                                 trainer.skip_zero_advantage_rows)
            self._log_optimizer_steps(optimizer_steps)
        if not drop:
            self.scheduler.step()
        trained = time.time()
        faults.strike("train", self.runtime.progress.global_step, self.topology.rank, self.cfg.run.output_dir)
        io_s += self.reader.commit(self.runtime.progress.global_step, stale=drop)
        if self.dataset is None:
            scalars["timing/buffer_read_s"] = io_s
        self.runtime.progress.add(train_s=trained - start, buffer_s=io_s)
        scalars.update(metrics)
        if self.router_loads is not None:  # an MoE model: how evenly its routers spread the step's tokens
            from megatron.core import parallel_state as ps

            scalars.update(self.router_loads.scalars(ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()))
        scalars.update(self.data_scalars)
        self.data_scalars = {}
        seconds = max(trained - start, 1e-9)
        tflops = metrics.get("train/model_flops", 0.0) / seconds / 1e12  # this rank's (rft/trainer/flops.py)
        scalars.update({"timing/train_s": trained - start, "perf/train_tokens_per_s": metrics["train/tokens"] / seconds,
                        "perf/model_tflops": tflops, "actor/lr": self.scheduler.get_last_lr()[0]})
        if self.peak_tflops:
            scalars["perf/mfu"] = tflops / self.peak_tflops
        return scalars

    def _chord_mu(self, stage: Stage) -> float:
        """CHORD's expert share at this step of the stage (rft/algorithms/chord.py)."""
        a = self.algo
        return chord_mu(self.runtime.progress.global_step - stage.start - 1, a.chord_mu_warmup_steps,
                        a.chord_mu_decay_steps, a.chord_mu_peak, a.chord_mu_valley)

    def _log_optimizer_steps(self, steps: list[dict[str, float]]) -> None:
        """With several optimizer steps per trainer step (algorithm.ppo_epochs, mini_batch_size),
        each one's scalars go to TensorBoard on an optimizer-step axis (rft/runtime/monitor.py)."""
        progress = self.runtime.progress
        first = int(progress.totals.get("optimizer_steps", 0)) + 1
        progress.add(optimizer_steps=len(steps))
        if len(steps) > 1 and self.runtime.monitor is not None:
            self.runtime.monitor.log_optimizer_steps(first, steps)

    def _staleness(self, rows, scalars: dict[str, float]):
        """buffer.max_staleness: a shard whose weights are too many trainer steps old is dropped
        (its step trains nothing) or re-weighted (truncated IS against vLLM's logprobs). Reused rows
        (replayed, labelled by a person) are old by design: they never drop a step, and a step
        holding them is re-weighted the same way."""
        progress, limit = self.runtime.progress, self.cfg.buffer.max_staleness
        lag = progress.global_step - 1 - min(rows.fresh.column("version").to_pylist())  # trainer steps since its weights
        scalars["policy/version_lag"] = lag
        algo, drop = self.algo, False
        if rows.table.num_rows > rows.fresh_rows:
            algo = replace(algo, tis_cap=algo.tis_cap or STALE_TIS_CAP)
        if limit is not None and lag > limit:
            drop = self.cfg.buffer.stale == "drop"
            progress.add(**{"stale_dropped" if drop else "stale_reweighted": 1})
            if not drop:  # off-policy correction against the logprobs vLLM sampled with
                algo = replace(algo, tis_cap=algo.tis_cap or STALE_TIS_CAP)
        scalars["buffer/stale_dropped"] = progress.totals.get("stale_dropped", 0)
        scalars["buffer/stale_reweighted"] = progress.totals.get("stale_reweighted", 0)
        return algo, drop
