"""Running a workflow over a batch of tasks: many trajectories in flight, each bounded in time,
retried when it fails, scored, and accounted for.

    for each task i, sample k (concurrently, at most rollout.max_concurrent_tasks at once):
        for try in 1 .. 1 + rollout.max_retries:
            experiences = await workflow(task, model, ctx) within rollout.task_timeout_s
            if it returned: score what has no reward (algorithm.reward); done
        after the last try: <run>/buffer/failed.jsonl gets the task, the error and its traceback
    a group reward (relative_judge): scores the task's samples together once all are back
    a teacher (on-policy distillation, rft/explorer/teacher.py): scores the task's samples' tokens

A workflow waiting on a tool or an environment holds only its own slot; the engine serves the
others meanwhile. A failed sample leaves its group one short (groups may be ragged); a task whose
every sample failed leaves no group at all. Nothing is dropped without a line in failed.jsonl.
A trajectory stays on the engine it started on (its prefix cache holds the conversation); new
trajectories go to the engine with the fewest requests in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import traceback
from dataclasses import dataclass, field

from rft.buffer.experience import Experience
from rft.config import RolloutConfig
from rft.data.chat_format import chat_format
from rft.data.taskset import Task
from rft.explorer.dealer import Deal, local_deal
from rft.explorer.model_client import ModelClient, Sampling
from rft.explorer.rewards import RewardScorer
from rft.explorer.teacher import Teacher
from rft.explorer.vllm_engine import RolloutEngine
from rft.explorer.workflows import WORKFLOWS, WorkflowContext


def _engine_failures() -> tuple[type[BaseException], ...]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return (EngineDeadError,)


ENGINE_FAILURES = _engine_failures()


@dataclass
class Outcome:
    """What one batch produced, and what it cost."""

    experiences: list[Experience]
    samples: int  # samples asked for (tasks this engine took x samples per task)
    failed: int = 0  # samples that failed every try (each has a line in failed.jsonl)
    retries: int = 0  # tries after a failed first one
    timeouts: int = 0  # tries cancelled by rollout.task_timeout_s
    reward_errors: int = 0  # samples whose reward raised or timed out (scored 0.0)
    tasks_run: list[int] = field(default_factory=list)  # indices of the batch's tasks this engine ran

    def add(self, other: Outcome) -> None:
        """Count `other` (more tasks of the same batch) in this outcome."""
        self.experiences += other.experiences
        self.tasks_run += other.tasks_run
        for name in ("samples", "failed", "retries", "timeouts", "reward_errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def oldest_version(exp: Experience, served: int) -> int:
    """The oldest weights version that sampled a token of `exp` (rollout.partial_rollout may mix
    versions in one generation); `served` (the engine's now) where every token has the same one."""
    if exp.token_versions is None:
        return served
    return min((v for v in exp.token_versions if v >= 0), default=served)


def sample_seed(*key: object) -> int:
    """A 48-bit seed from any key (run seed, step, round, task, sample): reproducible across runs
    and processes (Python's hash() is salted per process), and unrelated for neighbouring keys."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "big")


class WorkflowRunner:
    """Runs `rollout.workflow` for batches of tasks on `engines` (all on one event loop)."""

    def __init__(self, engines: list[RolloutEngine], rollout: RolloutConfig, reward: str, chat_template: bool,
                 failed_path: str, teacher: Teacher | None = None):
        self.engines, self.rollout, self.failed_path, self.teacher = engines, rollout, failed_path, teacher
        self.workflow = WORKFLOWS.resolve(rollout.workflow)
        self.scorer = RewardScorer(reward, rollout.reward_timeout_s)
        self.format = chat_format(engines[0].tokenizer, chat_template)

    def run(self, tasks: list[Task], samples: int, sampling: Sampling, seed_key: tuple, group_prefix: str,
            evaluation: bool = False, deal: Deal | None = None) -> Outcome:
        """`samples` trajectories of each task this engine is dealt (all of them without `deal`:
        rft/explorer/dealer.py); group i (task i) is named `<group_prefix>:<i>`. Blocks until every
        sample succeeded or failed for good; experiences come in task order."""
        deal = deal or local_deal(len(tasks))
        return self.engines[0].run(self._run(tasks, samples, sampling, seed_key, group_prefix, evaluation, deal))

    async def _run(self, tasks: list[Task], samples: int, sampling: Sampling, seed_key: tuple,
                   group_prefix: str, evaluation: bool, deal: Deal) -> Outcome:
        outcome = Outcome(experiences=[], samples=0)
        errors_before = self.scorer.errors + self.scorer.timeouts
        slots = asyncio.Semaphore(self.rollout.max_concurrent_tasks)
        # a per-task workflow (single_turn) samples a task's whole group in one call: one vLLM
        # request with n = samples, the prompt processed once; others are called once per sample
        calls = [(0, samples)] if WORKFLOWS.meta(self.workflow).get("per_task") else [(k, 1) for k in range(samples)]
        done: list[tuple[int, list[Experience]]] = []

        async def take_tasks() -> None:
            while (i := deal.claim()) < len(tasks):
                runs = [self._call(tasks[i], f"{group_prefix}:{i}", first, count, sampling,
                                   sample_seed(*seed_key, i, first), evaluation, slots, outcome)
                        for first, count in calls]
                group = [e for experiences in await asyncio.gather(*runs) for e in experiences]
                if self.scorer.group:
                    await self._score_group(group, tasks[i])
                if self.teacher is not None and not evaluation and group:
                    await self.teacher.score(group)
                done.append((i, group))
                outcome.samples += samples

        workers = [asyncio.ensure_future(take_tasks()) for _ in range(min(deal.window, len(tasks)))]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            # one worker's failure (a dead engine) ends the batch here: the others must not go on
            # claiming tasks and sending requests, to this engine or to one started in its place
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        for i, experiences in sorted(done, key=lambda d: d[0]):
            outcome.experiences += experiences
            outcome.tasks_run.append(i)
        outcome.reward_errors = self.scorer.errors + self.scorer.timeouts - errors_before
        return outcome

    async def _call(self, task: Task, group_id: str, first: int, count: int, sampling: Sampling, seed: int,
                    evaluation: bool, slots: asyncio.Semaphore, outcome: Outcome) -> list[Experience]:
        """Samples [first, first + count) of `task`: tried, retried, scored, named; [] if they failed."""
        tries = 1 + self.rollout.max_retries
        for attempt in range(tries):
            engine = min(self.engines, key=lambda e: e.in_flight)  # sticky for the whole trajectory
            model = ModelClient(engine, self.format, sampling, seed + 1000 * attempt)
            ctx = WorkflowContext(sample=first, samples=count, seed=seed, evaluation=evaluation,
                                  max_turns=self.rollout.max_turns, env=self.rollout.env,
                                  env_args=dict(self.rollout.env_args))
            try:
                async with slots:
                    returned = await asyncio.wait_for(self.workflow(task, model, ctx), self.rollout.task_timeout_s)
                experiences = self._checked(returned, count)
            except ENGINE_FAILURES:
                raise  # not the task's fault: the rank stops, naming the engine (rft/explorer/explorer.py)
            except asyncio.TimeoutError:
                outcome.timeouts += 1
                error, trace = (f"timed out after {self.rollout.task_timeout_s:g} s (rollout.task_timeout_s)",
                                "")
            except Exception as exc:  # the workflow's, its environment's or its tool's failure
                error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
            else:
                if not self.scorer.group:  # a group reward waits for the task's other samples (_score_group)
                    await self._score(experiences, task, count)
                for index, exp in enumerate(experiences):
                    sample = first + (index if count > 1 else 0)
                    exp.group_id, exp.trajectory_id = group_id, f"{group_id}:{sample}"
                    # the oldest weights that sampled any of its tokens: what its staleness is counted from
                    exp.task_id, exp.version = task.task_id, oldest_version(exp, engine.version)
                return experiences
            if attempt + 1 < tries:
                outcome.retries += 1
        outcome.failed += count
        self._record_failure(task, group_id, first, count, tries, error, trace, evaluation)
        return []

    @staticmethod
    def _checked(returned: object, count: int) -> list[Experience]:
        experiences = [returned] if isinstance(returned, Experience) else returned
        if not isinstance(experiences, list) or not experiences \
                or not all(isinstance(e, Experience) for e in experiences):
            raise TypeError(f"the workflow returned {type(returned).__name__}; it must return an Experience or a "
                            "non-empty list of them (rft/buffer/experience.py)")
        if count > 1 and len(experiences) != count:
            raise TypeError(f"a per-task workflow must return one experience per sample: {count} asked "
                            f"(ctx.samples), {len(experiences)} returned")
        for exp in experiences:
            exp.check()
        return experiences

    async def _score(self, experiences: list[Experience], task: Task, count: int) -> None:
        """algorithm.reward for experiences the workflow left unscored: one per sample of a
        per-task call, in one batch; several from one sample (step_wise: the steps of one
        trajectory) share the score of the last one, the trajectory's end."""
        unscored = [e for e in experiences if e.reward is None]
        if not unscored:
            return
        if count > 1:
            for exp, reward in zip(unscored, await self.scorer.score_async(unscored, [task] * len(unscored))):
                exp.reward = reward
            return
        (reward,) = await self.scorer.score_async([unscored[-1]], [task])
        for exp in unscored:
            exp.reward = reward

    async def _score_group(self, experiences: list[Experience], task: Task) -> None:
        """A group reward for the unscored samples of one task, in one call: a member per
        trajectory, its last experience (step_wise: the others share its score, as in _score)."""
        ends = {e.trajectory_id: e for e in experiences if e.reward is None}  # the last of each wins
        if not ends:
            return
        rewards = dict(zip(ends, await self.scorer.score_async(list(ends.values()), [task] * len(ends))))
        for exp in experiences:
            if exp.reward is None:
                exp.reward = rewards[exp.trajectory_id]

    def _record_failure(self, task: Task, group_id: str, first: int, count: int, tries: int, error: str,
                        trace: str, evaluation: bool) -> None:
        os.makedirs(os.path.dirname(self.failed_path), exist_ok=True)
        row = {"time": time.time(), "task_id": task.task_id, "task_index": task.index, "group_id": group_id,
               "sample": first, "samples": count, "tries": tries, "evaluation": evaluation, "error": error,
               "traceback": trace}
        with open(self.failed_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.scorer.close()
