"""One rollout rank's work in a stage: its engines, buffer, tasksets and workflow runner (`Explorer`).
The rank's loop over stages and steps that drives it is rft/explorer/rollout_rank.py.

    explore(step):
        tasks = selector.next_batch()                 # rft/data/selectors.py (data.selector)
        experiences = workflow(task) x group_size for each task   # vLLM, env, reward
        selector.observe(rewards); experiences = operators(experiences)   # rft/buffer/operators.py
        buffer.write(experiences)
    receive_weights(version) / keep_weights(version)  # what the trainer published at a control point
    evaluate(stage, when)                             # held-out tasks: stage start, interval, end
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable

import torch

from rft.algorithms.filters import SAMPLE_FILTERS
from rft.buffer.experience import Experience, to_table
from rft.buffer.operators import OperatorContext, OperatorPipeline
from rft.buffer.shards import ExperienceBuffer
from rft.config import (
    RFTConfig,
    adapter_sync,
    context_length,
    judge_model,
    needs_rollouts,
    operator_specs,
)
from rft.data.context_fit import ContextFit
from rft.data.judge_difficulty import (
    DifficultyScores,
    ask_judges,
    score_tasks,
    scores_path,
)
from rft.data.selectors import SELECTORS, build_selector
from rft.data.stage_tasks import read_stage_tasks
from rft.data.taskset import Task, row_scalars
from rft.explorer.dealer import Deal, Dealer
from rft.explorer.engine_restart import EngineRestarts
from rft.explorer.dynamic_sampling import filter_rows, run_filtered
from rft.explorer.journal import GenerationJournal, prune_journals
from rft.explorer.judge import JudgeClient
from rft.explorer.model_client import Sampling
from rft.explorer.openai_endpoint import rewarded_experiences, serve_endpoint
from rft.explorer.runner import ENGINE_FAILURES, Outcome, WorkflowRunner
from rft.explorer.teacher import Teacher, needs_teacher, unscored_rows
from rft.explorer.vllm_engine import RolloutEngine
from rft.explorer.workflows import required_columns
from rft.runtime import faults
from rft.runtime.colocation import EngineSleep
from rft.runtime.control import Runtime, Stage, Step
from rft.runtime.membership import restarts_so_far
from rft.runtime.monitor import drop_from_step, eval_path
from rft.runtime.preemption import StopFlag
from rft.runtime.state import Value
from rft.runtime.storage import append_jsonl
from rft.runtime.topology import Topology
from rft.weights.engines import sync_layout


class InFlightKeeper:
    """While a free-running step explores: once Slurm's stop signal comes, every engine records
    the requests it has in flight in the step's journal and goes on with them (RolloutEngine.
    keep_in_flight). The step still ends and the run stops at its boundary as usual; if Slurm
    kills the job before that, the restarted explorer goes on from those tokens. Not when
    synchronous: a cut draws the rest of a sample anew, and synchronous runs resume bit for bit."""

    def __init__(self, engines: list[RolloutEngine], stop: StopFlag, kept: threading.Event):
        self.engines, self.flag, self.kept = engines, stop, kept  # kept: once per run, not again each step
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="rft-in-flight-keeper", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.05):
            if self.flag.requested and not self.kept.is_set():
                self.kept.set()
                for engine in self.engines:
                    engine.keep_in_flight()
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def prune_adapters(root: str, keep: str) -> None:
    """Adapters of older versions than the one served (<run>/adapters/engine<k>/v<version>)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


class Explorer:
    """A rollout rank's engines, buffer, tasksets and workflow runner. With several engines in
    the job each explorer takes its share of every batch from the dealer (rft/explorer/dealer.py)
    and writes its own shard per step; engine 0 logs the evaluations, which every engine shares."""

    def __init__(self, cfg: RFTConfig, topology: Topology, engines: list[RolloutEngine], runtime: Runtime,
                 judges: JudgeClient | None = None):
        self.cfg, self.topology, self.engines, self.runtime, self.judges = cfg, topology, engines, runtime, judges
        run_dir = cfg.run.output_dir
        self.buffer = ExperienceBuffer.for_run(cfg)
        runtime.group.meeting.while_waiting = self.resend_quarantined  # the trainer may wait for one
        self.failed_path = os.path.join(self.buffer.root, "failed.jsonl")
        self.version = runtime.state.track("version", Value(0))  # the weights the engines serve
        for engine in engines:
            engine.version = self.version.value
        if runtime.resumed_at is not None:
            drop_from_step(eval_path(run_dir), runtime.resumed_at)  # evals after the checkpoint run again
        # the engines of the weight groups this rank joined, and the job's engine restarts when it did
        self.receiving_from: tuple[list[int], int] | None = None
        self.adapter: dict | None = None  # a LoRA stage's adapter syncs (begin)
        self.engine = topology.engine_index
        self.dealer = Dealer(runtime.group.store, self.engine, topology.engine_count, cfg.sync.timeout_s,
                             ranks=topology.engine_leaders, tolerated=topology.losable_ranks)
        # sample seeds name the batch, never the engine (any engine may run any task); the first
        # rollout rank's number keeps the seeds that single-engine runs had
        self.first_rollout_rank = topology.trainer_ranks
        self.runner: WorkflowRunner | None = None
        self.selector = None  # the stage's task selector (rft/data/selectors.py); None: nothing to explore
        self.observes = False  # whether the selector is told the rewards (not for shuffle, sequential, curriculum)
        tokenizer = engines[0].tokenizer
        self.operators = OperatorPipeline(operator_specs(cfg.buffer.operators),
                                          OperatorContext(run_dir, engine=self.engine, decode=tokenizer.decode))
        self.eval_tasks: list[Task] = []
        self.endpoint = serve_endpoint(cfg, engines[0], self.dealer, self.engine) if cfg.rollout.openai_api else None
        self.sleep = EngineSleep(cfg, topology, engines, runtime) if cfg.cluster.colocate else None
        self.continued = 0  # samples continued after a weight update cut them, all steps (partial rollout)
        self.replayed = 0  # samples taken from an earlier attempt's generation journal, all steps
        self.resumed = 0  # samples gone on from the tokens an earlier attempt had when stopped, all steps
        self.kept = threading.Event()  # Slurm's stop signal came: the requests in flight were recorded
        self.restarts = EngineRestarts(cfg, topology, runtime, engines)  # rollout.on_engine_failure=restart
        # a checkpoint covers the steps up to this rank's position: their journals go
        runtime.save_hooks.append(lambda done: prune_journals(cfg.run.output_dir, topology.rank,
                                                              runtime.progress.global_step))

    def resend_quarantined(self) -> None:
        """Write again the shards of ours the trainer quarantined for a bad checksum."""
        for name in self.buffer.resend_quarantined():
            print(f"engine {self.engine}: shard {name} failed its checksum at the trainer; written again "
                  "from this explorer's copy", flush=True)

    def _sessions(self) -> list[Experience]:
        """The endpoint's sessions rewarded since the last step, as experience."""
        return rewarded_experiences(self.endpoint) if self.endpoint is not None else []

    # ---- a stage -----------------------------------------------------------------------------

    def begin(self, stage: Stage) -> None:
        """The stage's tasksets and runner; evaluate at its start (unless resumed inside it)."""
        cfg, data, rollout, rows = self.cfg, stage.cfg.data, stage.cfg.rollout, self.runtime.progress.rows
        # a LoRA stage syncing adapters: the first sync of the stage (and attempt) brings its base
        # weights too, as the trainer sends them (rft/trainer/publisher.py)
        lora = stage.cfg.trainer.lora
        self.adapter = {"dir": os.path.join(cfg.run.output_dir, "adapters", f"engine{self.engine}"),
                        "rank": lora.rank, "alpha": lora.alpha, "base": True} if adapter_sync(stage.cfg) else None
        self.runner = WorkflowRunner(self.engines, rollout, stage.cfg.algorithm.reward, cfg.model.chat_template,
                                     self.failed_path, teacher=Teacher(context_length(judge_model(cfg)))
                                     if needs_teacher(stage.cfg.algorithm.advantage) else None)
        columns = required_columns(rollout.workflow, rollout.env, stage.cfg.algorithm.reward)
        fit = ContextFit(self.engines[0].tokenizer, cfg.model.chat_template, self.topology.context_length, data.overlong,
                         getattr(self.engines[0], "image_processor", None))

        def tasks(path: str, train: bool = False) -> list[Task]:
            cleaned_in = (cfg.run.output_dir, stage.name) if train else None  # data.operators clean the train set
            read = read_stage_tasks(path, data, rows, required=columns, cleaned_in=cleaned_in)
            if "prompt" not in columns:  # the environment writes the prompt: the conversation keeps to the context
                return read
            return fit.for_rollouts(read, path, rollout.max_new_tokens, rows)

        self.eval_tasks = tasks(data.eval_path)[: data.eval_limit] if data.eval_path else []
        self.selector = None
        judged: dict[str, float] = {}  # data.judge_difficulty's counts, logged at the stage's start
        if needs_rollouts(stage.cfg):
            # tracked as "cursor": a checkpoint of the plain cursor resumes into the shuffle selector
            train = tasks(data.train_path, train=True)
            if data.judge_difficulty.enabled:
                judged = self._judge_difficulty(stage, train).scalars()
            selector = build_selector(train, cfg.seed + stage.index, data.selector)
            self.selector = self.runtime.state.track("cursor", selector, restore=stage.resumed)
            self.observes = not SELECTORS.meta(type(selector)).get("ignores_rewards")
        if not stage.resumed:
            files = [data.eval_path] + ([data.train_path] if self.selector else [])
            self.runtime.log(stage, stage.start, {**row_scalars(rows, files), **judged})
            self.evaluate(stage, "start", stage.start)

    def _judge_difficulty(self, stage: Stage, train: list[Task]) -> DifficultyScores:
        """Fill the train tasks' difficulty column from the judges (data.judge_difficulty): engine 0
        asks them and writes the scores; the other engines, and a resumed run, read its file."""
        settings = stage.cfg.data.judge_difficulty
        path = scores_path(self.cfg.run.output_dir, stage.name, stage.cfg.data.train_path)

        def ask() -> DifficultyScores:
            return self.engines[0].run(ask_judges(train, settings, self.judges))

        return score_tasks(train, settings, path, ask if self.engine == 0 else None, self.cfg.sync.timeout_s)

    def end(self) -> None:
        self.runner.close()
        self.runtime.state.untrack("cursor")

    # ---- a step ------------------------------------------------------------------------------

    def explore(self, stage: Stage, step: Step) -> dict[str, float]:
        """Generate the step's experience and write it as this rank's shard of the step."""
        if self.selector is None:  # a dataset stage (SFT): the explorer only evaluates
            return {}
        self.wake(step.global_step)
        self.resend_quarantined()
        algo, rollout = stage.cfg.algorithm, stage.cfg.rollout
        sampling = Sampling(rollout.temperature, rollout.top_p, rollout.max_new_tokens, tuple(rollout.stop))
        outcomes: list[Outcome] = []
        start = time.time()

        def generate(num_tasks: int, round_index: int) -> list[Experience]:
            key = (self.cfg.seed, step.global_step, round_index, self.first_rollout_rank)
            batch = f"{step.global_step}:{round_index}"
            outcomes.append(self._run_dealt(self.selector.next_batch(num_tasks), algo.group_size, sampling, key, batch))
            self._observe(outcomes[-1].experiences, batch)
            return outcomes[-1].experiences

        def kept_by_all(kept: int, round_index: int) -> int:
            return self.dealer.total(f"kept:{step.global_step}:{round_index}", kept)

        sample_filter = filter_rows(SAMPLE_FILTERS.resolve(algo.sample_filter))
        self.operators.ctx.step = step.global_step
        with self.journaled(step.global_step):  # a restarted attempt takes again what this one sampled
            experiences, filter_stats = run_filtered(generate, lambda rows: self.operators(sample_filter(rows)),
                                                     rollout.tasks_per_step, rollout.max_sampling_rounds, kept_by_all)
        sessions = self._sessions()  # rollout.openai_api: what agents outside the run finished
        experiences += sessions
        generated = time.time()
        faults.strike("generation", step.global_step, self.topology.rank, self.cfg.run.output_dir)
        if self.cfg.sync.decoupled and self.buffer.written(step.global_step - 1, self.topology.rank):
            # a decoupled explorer's restart: the trainer job may have trained it already (rft/runtime/decoupled.py)
            print(f"step {step.global_step}: its shard was written before the restart; kept, not written again",
                  flush=True)
        else:
            self.buffer.write(to_table(experiences), step=step.global_step - 1, producer=self.topology.rank,
                              version=self.version.value)
        written = time.time()
        self.runtime.progress.add(rollout_s=generated - start, buffer_s=written - generated,
                                  reward_errors=sum(o.reward_errors for o in outcomes),
                                  failed_samples=sum(o.failed for o in outcomes))
        return {"timing/rollout_s": generated - start, "timing/buffer_write_s": written - generated,
                "perf/tokens_per_s": sum(e.sampled_tokens for e in experiences) / max(generated - start, 1e-9),
                **outcome_scalars(outcomes, experiences, "rollout"), **filter_stats, **self._judge_scalars(),
                **self.operators.take_scalars(), **self.selector.scalars(),
                **({"rollout/sessions": float(len({e.trajectory_id for e in sessions}))} if self.endpoint else {}),
                **({"rollout/engines": float(self.dealer.present())} if self.dealer.count > 1 else {}),
                **({"rollout/teacher_unscored": float(unscored_rows(experiences))} if self.runner.teacher is not None
                   else {}),
                **self._continued_scalars(rollout.partial_rollout)}

    @contextlib.contextmanager
    def journaled(self, step: int):
        """The engines record the step's requests in its generation journal, and take back what an
        earlier attempt recorded there (rft/explorer/journal.py). Free-running, Slurm's stop signal
        also records the requests in flight (InFlightKeeper). Not with routing replay: the journal
        keeps no routes."""
        if self.cfg.trainer.routing_replay == "rollout":
            yield
            return
        run_dir, rank = self.cfg.run.output_dir, self.topology.rank

        def strike(event: str) -> None:  # the faults tests inject (rft/runtime/faults.py)
            point = {"request": "generating", "kept": "in_flight"}.get(event)
            if point is not None:
                faults.strike(point, step, rank, run_dir)
            if event == "recorded":  # a request answered: the engine's own faults
                faults.strike_engine(step, rank, run_dir, lambda: [pid for e in self.engines for pid in e.core_pids()])

        journal = GenerationJournal(run_dir, rank, step, listener=strike)
        for engine in self.engines:
            engine.journal = journal
        keeper = InFlightKeeper(self.engines, self.runtime.stop, self.kept) if self.cfg.sync.free_run else None
        try:
            yield
        finally:
            if keeper is not None:
                keeper.stop()
            for engine in self.engines:
                engine.journal = None
            journal.close()

    def _continued_scalars(self, partial: bool) -> dict[str, float]:
        """Samples taken from an earlier attempt's journal this step (finished there, or gone on
        from the tokens it had when stopped), and (rollout.partial_rollout) samples a weight update
        cut that went on with newer weights."""
        replayed, resumed, continued = (sum(getattr(engine, name) for engine in self.engines)
                                        for name in ("replayed", "resumed", "continued"))
        counts = {"rollout/replayed_samples": replayed - self.replayed, "rollout/resumed_samples": resumed - self.resumed}
        if partial:
            counts["rollout/continued_samples"] = continued - self.continued
        self.replayed, self.resumed, self.continued = replayed, resumed, continued
        return {key: float(value) for key, value in counts.items() if value or key.endswith("continued_samples")}

    def _observe(self, experiences: list[Experience], batch: str) -> None:
        """Tell the selector each trajectory's reward (before any operator reshapes it); with
        several engines every engine's, so that every engine's selector stays the same."""
        if not self.observes:
            return
        trajectories = {e.trajectory_id: e for e in experiences}.values()  # step_wise: one per trajectory
        seen = [(e.task_id, float(e.reward)) for e in trajectories]
        if self.dealer.count > 1:
            seen = [pair for share in self.dealer.gather(f"observe:{batch}", seen).values() for pair in share]
        self.selector.observe([task for task, _ in seen], [reward for _, reward in seen])

    def _run_dealt(self, tasks: list[Task], samples: int, sampling: Sampling, key: tuple, batch: str,
                   evaluation: bool = False) -> Outcome:
        """This engine's share of a batch (rft/explorer/dealer.py), and of the tasks an engine lost
        on the way took with it."""
        def run(deal: Callable[[], Deal]) -> Outcome:
            while True:
                try:
                    outcome = self.runner.run(tasks, samples, sampling, key, batch, evaluation, deal=deal())
                except ENGINE_FAILURES as failure:  # with restart: the engine again, and its share again
                    if not self.restarts.recover(failure):
                        raise
                    continue
                lost = self.restarts.lost_after(batch)
                if lost:  # restarted now, before this batch's shard lets the trainer go on to a weight sync
                    print(f"rft: {'; '.join(lost)}", flush=True)
                    died = ENGINE_FAILURES[0]()
                    if not self.restarts.recover(died):
                        raise died
                return outcome

        # after a restart the counter goes on: what the dead attempt had taken is dealt again below
        outcome = run(lambda: self.dealer.deal(batch, len(tasks)))
        again = 0
        while (deal := self.dealer.redeal(f"{batch}/again{again}", len(tasks), outcome.tasks_run)) is not None:
            outcome.add(run(lambda: deal))
            again += 1
        if again:
            print(f"engine {self.engine}: an engine was lost in batch {batch}; its tasks were dealt again "
                  f"to the {self.dealer.present()} engine(s) left", flush=True)
        return outcome

    def _judge_scalars(self) -> dict[str, float]:
        """judge/calls, timeouts, errors, latency, parse failures since the last call; added to the run's totals."""
        if self.judges is None:
            return {}
        counts = self.judges.take_counts()
        self.runtime.progress.add(judge_calls=counts.calls, judge_timeouts=counts.timeouts, judge_errors=counts.errors,
                                  judge_parse_failures=counts.parse_failures)
        return counts.scalars()

    def hand_over(self, versions: list[int]) -> None:
        """Colocated (cluster.colocate): the engines sleep, and the trainer may train the steps
        `versions` (their control points follow) on the GPUs they share."""
        if self.sleep is not None:
            self.sleep.hand_over(versions)

    def wake(self, step: int) -> None:
        """Colocated: the engines awake (weights and KV cache) before generating."""
        if self.sleep is not None:
            self.sleep.wake(step)

    def receive_weights(self, version: int) -> float:
        """Take the weights the trainer publishes now (as `version`); the seconds the engines
        spent loading them. Colocated engines wake their weights first and their KV cache after."""
        if self.sleep is None:
            return self._receive_weights(version)
        with self.sleep.loading(version):
            return self._receive_weights(version)

    def _receive_weights(self, version: int) -> float:
        # the engines at the vote before this sync: with rollout.on_engine_failure=continue a lost one
        # is left out, and the groups are opened anew without it (the trainer sees the same vote)
        present = [r for r in self.topology.engine_leaders if r in self.runtime.group.present]
        # with restarts, a restarted engine's new process takes its place in new groups (the trainer
        # reads the same count after the same meeting)
        restarts = restarts_so_far(self.runtime.group.store) if self.restarts.allowed else 0
        if (present, restarts) != self.receiving_from:  # the trainer opens the groups at its first sync, not before
            layout = sync_layout(self.cfg, self.topology, torch.cuda.is_available(), present, restarts)
            first = present.index(self.topology.rank) * self.cfg.rollout.tensor_parallel_size
            for engine in self.engines:
                engine.open_weight_receiver(layout, first)
            self.receiving_from = (present, restarts)
        applied = max(engine.receive_weights(adapter=self.adapter, version=version) for engine in self.engines)
        self.version.value = self.engines[0].version
        if self.adapter is not None:
            self.adapter["base"] = False
            prune_adapters(self.adapter["dir"], keep=self.engines[0].lora_request.lora_path)
        return applied

    def keep_weights(self, version: int) -> None:
        """The weights served are the trainer's at `version` already (no optimizer step since the
        last sync): nothing travels or loads, and what is generated from now on is labelled
        `version`, as the staleness checks compare it with the trainer's steps."""
        for engine in self.engines:
            engine.version = version
        self.version.value = version

    def evaluate(self, stage: Stage, when: str, global_step: int) -> None:
        """Mean reward of one greedy (rollout.eval_temperature) sample per eval task, and the
        means of the workflow's metrics (turns, success, ...): eval/accuracy, eval/<metric>."""
        if not self.eval_tasks:
            return
        self.wake(global_step)
        rollout = stage.cfg.rollout
        start = time.time()
        sampling = Sampling(rollout.eval_temperature, 1.0, rollout.max_new_tokens, tuple(rollout.stop))
        batch = f"eval-{stage.index}-{when}-{global_step}"
        outcome = self._run_dealt(self.eval_tasks, 1, sampling, (self.cfg.seed, "eval"), batch, evaluation=True)
        self.runtime.progress.add(eval_s=time.time() - start, reward_errors=outcome.reward_errors,
                                  failed_samples=outcome.failed, eval_samples=outcome.samples)
        judged = self._judge_scalars()  # the evaluation's judge calls count in the totals
        shares = self.dealer.gather(batch, outcome)  # every engine's share; the first present one reports
        if self.engine != min(shares):
            return
        outcomes = list(shares.values())
        experiences = [e for o in outcomes for e in o.experiences]
        trajectories = {e.trajectory_id: e for e in experiences}.values()  # step_wise: one per trajectory
        accuracy = sum(float(e.reward) for e in trajectories) / len(self.eval_tasks)  # a failed task scores 0
        metrics = {key.removeprefix("eval/"): value
                   for key, value in outcome_scalars(outcomes, list(trajectories), "eval").items()}
        self.runtime.log(stage, global_step, {"eval/accuracy": accuracy, **{f"eval/{k}": v for k, v in metrics.items()},
                                              **{f"eval/{k}": v for k, v in judged.items()}})
        append_jsonl(eval_path(self.cfg.run.output_dir), {
            "stage": stage.name, "when": when, "step": global_step, "version": self.version.value,
            "accuracy": accuracy, "num_tasks": len(self.eval_tasks), "metrics": metrics})


def outcome_scalars(outcomes: list[Outcome], experiences: list[Experience], prefix: str) -> dict[str, float]:
    """Per-trajectory means of turns, tool calls and the workflow's metrics, and what failed."""
    trajectories = list({e.trajectory_id: e for e in experiences}.values())
    n = max(len(trajectories), 1)
    out = {f"{prefix}/turns": sum(e.turns for e in trajectories) / n,
           f"{prefix}/tool_calls": sum(e.tool_calls for e in trajectories) / n,
           f"{prefix}/failed_samples": float(sum(o.failed for o in outcomes)),
           f"{prefix}/retries": float(sum(o.retries for o in outcomes)),
           f"{prefix}/timeouts": float(sum(o.timeouts for o in outcomes)),
           f"{prefix}/reward_errors": float(sum(o.reward_errors for o in outcomes))}
    for key in sorted({k for e in trajectories for k in e.metrics}):
        values = [e.metrics[key] for e in trajectories if key in e.metrics]
        out[f"{prefix}/{key}"] = sum(values) / len(values)
    return out
