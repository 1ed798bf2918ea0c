"""The plumbing around a rank's loop, so the loop itself reads as the algorithm:

    runtime = Runtime(cfg, topology, group, stop, resume, "trainer0")
    for stage in runtime.stages():                   # a resumed run re-enters where it saved
        for step in stage.steps():                   # step.resumed: done before the checkpoint
            ... the algorithm: scalars of the step ...
            for point in stage.control_points(step): # the trainer steps this step meets
                point.meet(scalars)                  # vote: stop? save? -> every rank saves alike
                if point.publishes: ... weight sync (point.sends_weights: unless unchanged) ...
            runtime.log(stage, step, scalars)
    return runtime.finish({...})

A control point is where every rank of the job meets once per trainer step (rft/runtime/preemption.py's
ControlGroup): they vote whether Slurm asked them to stop (SIGUSR2) and whether a checkpoint is
due (trainer.save_every_min, trainer.save_interval); if so, every rank saves its tracked state
(rft/runtime/state.py) for the same step, and on a stop rank 0 requeues the job. The trainer
meets its own steps; the explorer meets the trainer steps its step pairs with (rft/runtime/schedule.py).
A checkpoint holds each rank's step up to its control point; the weight sync after it is the
first thing a resumed run does (`point.publishes` is then always true).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rft.config import RFTConfig, stage_configs
from rft.runtime.checkpoint import Resume, SaveClock, record_save_timing, record_stand_ins
from rft.runtime.free_run import TrainerVotes
from rft.runtime.monitor import Monitor, peak_rss_gb, progress_path, rank_summary_path, write_json_atomic
from rft.runtime.preemption import ControlGroup, StopFlag, requeue_or_stop
from rft.runtime.schedule import free_running, paired_trainer_steps, publishes_after
from rft.runtime.state import Progress, RankState
from rft.runtime.topology import Topology


@dataclass
class Step:
    index: int  # step of the stage, 0-based
    global_step: int  # steps done over all stages once this one is (what logs and checkpoints count)
    resumed: bool = False  # done before the checkpoint this run resumed from: only its sync is left
    pending: dict[str, float] = field(default_factory=dict)  # its scalars then


class Runtime:
    """One rank's position, checkpoints, votes and logs (see the module docstring)."""

    def __init__(self, cfg: RFTConfig, topology: Topology, group: ControlGroup, stop: StopFlag, resume: Resume | None,
                 rank_name: str, monitor: bool = True):
        self.cfg, self.topology, self.group, self.stop = cfg, topology, group, stop
        self.state = RankState(cfg.run.output_dir, topology, resume)
        # resolved once: resolving through OmegaConf's schema took a third of a quickstart SFT step
        self.stage_plan = stage_configs(cfg)
        if topology.rank < topology.trainer_ranks and any(c.trainer.async_save for _, c in self.stage_plan):
            # started now, at the lowest priority beside the trainer's own start: not in the first save's stall
            self.state.start_writer()
        self.progress = self.state.track("progress", Progress())
        self.resumed_at = self.progress.global_step if self.state.resuming else None
        self.monitor = Monitor(cfg, rank_name, self.resumed_at) if monitor else None
        self.clock = SaveClock(cfg.trainer.save_every_min)
        self.last_met: float | None = None  # when this rank last met at a control point
        self.save_hooks: list[Callable[[int], None]] = []  # with every checkpoint, on every rank (HF export)
        self.saved_hooks: list[Callable[[int], None]] = []  # once every rank has saved (pruning)
        # free-running stages (rft/runtime/free_run.py): the trainer ranks meet at their steps alone
        self.trainer_votes = None
        if cfg.sync.free_run and topology.rank < topology.trainer_ranks:
            self.trainer_votes = TrainerVotes(group.store, topology.trainer_ranks, topology.rank, cfg.sync.timeout_s,
                                              topology.member_name)

    def stages(self) -> Iterator[Stage]:
        """The run's stages from where this rank resumes; the checkpoint's stage is re-entered at
        its step, later stages start fresh (stage components restore only in the first one)."""
        start = 0
        for index, (name, cfg) in enumerate(self.stage_plan):
            resumed = self.state.resuming and index == self.progress.stage_index
            if not self.state.resuming or index >= self.progress.stage_index:
                yield Stage(self, index, name, cfg, start, resumed)
                self.state.resumed()
            start += cfg.trainer.max_steps

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Add the seconds spent inside to the run's total `key`."""
        start = time.time()
        yield
        self.progress.add(**{key: time.time() - start})

    def log(self, stage: Stage, step: int, scalars: dict[str, float]) -> None:
        if self.monitor is not None and scalars:
            self.monitor.log(step, scalars, stage.name)

    def show_progress(self, stage: Stage, step: int, scalars: dict[str, float]) -> None:
        """The launcher's progress bar: written by rank 0 (the trainer's, or mode=explore's engine)."""
        write_json_atomic(progress_path(self.cfg.run.output_dir), {
            "stage": stage.name, "stage_index": stage.index, "num_stages": len(self.stage_plan), "step": step,
            "total_steps": sum(s.trainer.max_steps for _, s in self.stage_plan), "reward": scalars.get("reward/mean")})

    def save(self, done: int, stage: Stage, step: Step, voted: int, scalars: dict[str, float],
             step_s: float | None = None, stopping: bool = False) -> None:
        """Every rank's state for `done` trainer steps; the checkpoint is complete when all wrote
        (in a free-running stage the explorer adds its file later: `save_own`; with
        trainer.async_save the trainer ranks' files come once their shards are written:
        `complete_background`). A stop saves in the foreground: the job ends right after."""
        started = time.time()
        self.save_own(done, stage, step, voted, scalars, background=stage.cfg.trainer.async_save and not stopping)
        stage.voters.any(False)  # every rank's file is written: the checkpoint is complete
        if self.topology.rank == 0:
            record_save_timing(self.cfg.run.output_dir, done, time.time() - started, step_s)
        absent = [r for r in self.group.members if r not in self.group.present]
        if absent:  # engines lost (rollout.on_engine_failure=continue): complete once rank 0 names stand-ins
            if self.topology.rank == 0:
                engines = [r for r in self.group.present if r in self.group.meeting.tolerated]
                record_stand_ins(self.cfg.run.output_dir, done, {r: engines[0] for r in absent})
            self.group.any(False)
        for hook in self.saved_hooks:
            hook(done)

    def save_own(self, done: int, stage: Stage, step: Step, voted: int = 0, scalars: dict[str, float] | None = None,
                 background: bool = False) -> None:
        """This rank's file of checkpoint `done`, holding its position `step` (a free-running
        explorer's is at or after `done`: rft/runtime/free_run.py); `background`: its shards
        written while it goes on (rft/runtime/background_save.py)."""
        p = self.progress
        p.global_step, p.stage_index, p.step, p.voted, p.pending = step.global_step, stage.index, step.index, voted, scalars or {}
        if self.monitor is not None:  # the steps before this checkpoint are in every tracker: a resume logs only later ones
            self.monitor.flush()
        self.state.save(done, background)
        for hook in self.save_hooks:
            hook(done)
        self.clock.saved()

    def complete_background(self) -> None:
        """Trainer ranks together: complete the checkpoint being written in the background, if any
        (waiting for the write), and prune older ones."""
        done = self.state.finish_background()
        if done is not None:
            for hook in self.saved_hooks:
                hook(done)

    def finish(self, summary: dict) -> dict:
        """Close the logs and write this rank's summary (rft/launch/report.py reads it)."""
        self.complete_background()  # every trainer rank ends here: the last checkpoint completes
        if self.monitor is not None:
            self.monitor.close()
        out = {"rank": self.topology.rank, "steps": self.progress.global_step, "wall_s": self.progress.elapsed_s,
               "skipped_rows": self.progress.rows, "peak_rss_gb": peak_rss_gb(), **self.progress.totals, **summary}
        write_json_atomic(rank_summary_path(self.cfg.run.output_dir, self.topology.rank), out)
        return out


class Stage:
    """One stage of the run as this rank goes through it."""

    def __init__(self, runtime: Runtime, index: int, name: str, cfg: RFTConfig, start: int, resumed: bool):
        self.runtime, self.index, self.name, self.cfg = runtime, index, name, cfg
        self.start = start  # global steps of the stages before
        self.resumed = resumed  # re-entered from a checkpoint taken in this stage
        progress = runtime.progress
        # free-running (sync.free_run, rollout stages): the explorer never meets the trainer's steps
        self.free = free_running(runtime.cfg, cfg)
        self.voters = runtime.trainer_votes if self.free and runtime.trainer_votes is not None else runtime.group
        self.first_step = progress.step if resumed else 0
        self._voted, self._pending = (progress.voted, progress.pending) if resumed else (0, {})

    def steps(self) -> Iterator[Step]:
        for index in range(self.first_step, self.cfg.trainer.max_steps):
            resumed = self.resumed and index == self.first_step
            self.runtime.progress.global_step = self.start + index + 1
            yield Step(index, self.start + index + 1, resumed, dict(self._pending) if resumed else {})

    def control_points(self, step: Step, role: str) -> list[ControlPoint]:
        """The trainer steps `step` meets: the trainer its own; the explorer those paired with it
        (rft/runtime/schedule.py). A resumed step has met them up to the one its checkpoint came from."""
        steps = [step.index] if role == "trainer" else paired_trainer_steps(self.runtime.cfg, self.cfg, step.index)
        if step.resumed:
            steps = [t for t in steps if t >= self._voted]
        return [ControlPoint(self, step, t, met=step.resumed and t == self._voted) for t in steps]


class ControlPoint:
    """Trainer step `t`'s meeting of every rank (see the module docstring)."""

    def __init__(self, stage: Stage, step: Step, t: int, met: bool):
        self.stage, self.step, self.t, self.met = stage, step, t, met
        runtime = stage.runtime
        # after a resume the restarted explorer holds the initial weights: always send them
        self.publishes = publishes_after(runtime.cfg, stage.cfg, stage.start, t, resumed=met)
        # at a publishing point: whether the weights travel, or the engines only take the new
        # version, their weights being the trainer's already (no optimizer step since the last sync)
        self.sends_weights = True
        self.version = stage.start + t + 1  # what the weights published here are called: trainer steps done

    def meet(self, scalars: dict[str, float], weights_changed: bool = False) -> None:
        """Vote; if a checkpoint is due every rank saves (with `scalars`, the step's pending log
        line); if Slurm asked to stop, then requeue or stop. Met already if resumed here.
        `weights_changed` (the trainer's: an optimizer step since its last sync) decides, for every
        rank alike, whether a publishing point sends weights."""
        if self.met:
            return
        runtime, cfg, voters = self.stage.runtime, self.stage.runtime.cfg, self.stage.voters
        stopping, save_due, self.sends_weights, writing = voters.vote(runtime.stop.requested, runtime.clock.due(),
                                                                     weights_changed, runtime.state.writing)
        if runtime.state.background is not None and not writing:  # every trainer rank's shards are written
            runtime.complete_background()
        now = time.time()  # a step's time: from this rank's previous control point to this one
        step_s, runtime.last_met = (None if runtime.last_met is None else now - runtime.last_met), now
        done = self.stage.start + self.t + 1  # trainer steps done: what the checkpoint is named by
        interval = self.stage.cfg.trainer.save_interval  # a stage may set its own (stages[i].trainer.save_interval)
        if stopping or save_due or (interval and done % interval == 0):
            runtime.save(done, self.stage, self.step, self.t, scalars, step_s, stopping)
            if self.stage.free and runtime.topology.rank == 0:  # the explorer's file completes it
                voters.request_save(done, stopping)
            if stopping:
                if runtime.monitor is not None:
                    runtime.monitor.close()
                requeue_or_stop(runtime.group, runtime.stop, cfg.run.output_dir, done, cfg.cluster)

    def offer(self) -> None:
        """Free-running, trainer rank 0 before this point's sync: the engines may take the weights."""
        if self.stage.free and self.stage.runtime.topology.rank == 0:
            self.stage.voters.offer(self.version, self.sends_weights)

