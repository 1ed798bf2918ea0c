"""The rollout rank: run the workflow over each step's tasks, write the experience, take new weights.

    for each stage:
        evaluate (stage start)
        for each step:
            tasks = selector.next_batch()                 # rft/data/selectors.py (data.selector)
            experiences = workflow(task) x group_size for each task   # vLLM, env, reward
            selector.observe(rewards); experiences = operators(experiences)   # rft/buffer/operators.py
            buffer.write(experiences)
            colocated: the engines sleep, the trainer's turn  # rft/runtime/colocation.py (cluster.colocate)
            for each trainer step this step meets:       # rft/runtime/schedule.py (sync.offset)
                vote at its control point                 # stop? checkpoint? (rft/runtime/control.py)
                receive the weights the trainer published after it, if it did
            (free-running, sync.free_run: no meetings; take the newest weights offered, and wait only
             while the next shard would be too stale: rft/explorer/free_run.py)
        evaluate (stage end)
"""

from __future__ import annotations

import time

from rft.config import RFTConfig, vllm_lora_rank
from rft.explorer.decoupled import WeightFollower
from rft.explorer.explorer import Explorer
from rft.explorer.free_run import FreeRunning
from rft.explorer.journal import remove_journals
from rft.explorer.judge import JudgeClient
from rft.explorer.vllm_engine import LoopThread, RolloutEngine
from rft.runtime.checkpoint import Resume
from rft.runtime.control import Runtime, Stage
from rft.runtime.preemption import ControlGroup, StopFlag
from rft.runtime.schedule import free_running, is_eval_step
from rft.runtime.topology import Topology


def run_explorer(cfg: RFTConfig, topology: Topology, group: ControlGroup, stop: StopFlag, resume: Resume | None) -> dict:
    """Explore every stage; with `resume`, start at its pending sync (rft/runtime/checkpoint.py)."""
    started = time.time()
    stop.ignore_in_children()  # vLLM's engine process must survive Slurm's SIGUSR2
    # one engine per rank; the job's engines share each step's tasks (rft/explorer/dealer.py)
    engines = [RolloutEngine(cfg.model, cfg.rollout, cfg.seed + topology.rank, topology.context_length,
                             name=f"engine {topology.engine_index}", loop=LoopThread(),
                             max_lora_rank=vllm_lora_rank(cfg),
                             return_routed_experts=cfg.trainer.routing_replay == "rollout",
                             sleep_mode=cfg.cluster.colocate)]
    stop.install()
    judges = _connect_judges(cfg, topology, group) if topology.judge_ranks else None
    runtime = Runtime(cfg, topology, group, stop, resume, f"rollout{topology.rank}")
    # startup overlaps the trainer's first steps
    runtime.progress.add(startup_s=time.time() - started, rollout_s=0.0, buffer_s=0.0, sync_wait_s=0.0, eval_s=0.0,
                         reward_errors=0, failed_samples=0, eval_samples=0,
                         **({"judge_calls": 0, "judge_timeouts": 0, "judge_errors": 0, "judge_parse_failures": 0}
                            if judges else {}))
    explorer = Explorer(cfg, topology, engines, runtime, judges)
    free = FreeRunning(cfg, topology, runtime, explorer)
    follower = WeightFollower(cfg, explorer) if cfg.sync.decoupled else None  # the trainer job's weights
    for stage in runtime.stages():
        explorer.begin(stage)
        if free_running(cfg, stage.cfg):  # sync.free_run: no meetings at the trainer's steps
            free.run_stage(stage)
        else:
            run_lockstep(explorer, stage, follower)
        if follower is not None:
            follower.at_end(stage)
        explorer.evaluate(stage, "end", stage.start + stage.cfg.trainer.max_steps)
        explorer.end()
    if explorer.endpoint is not None:
        explorer.endpoint.close()
    for engine in engines:
        engine.close()
    explorer.restarts.close()
    remove_journals(cfg.run.output_dir, topology.rank)  # no step is left to take again
    return runtime.finish({"role": "rollout", "version": explorer.version.value})


def run_lockstep(explorer: Explorer, stage: Stage, follower: WeightFollower | None = None) -> None:
    """A stage's steps, each meeting the trainer steps it pairs with (rft/runtime/schedule.py).
    A decoupled explorer meets no trainer: `follower` loads the trainer job's weights before each step."""
    runtime = explorer.runtime
    for step in stage.steps():
        if step.resumed:
            scalars = step.pending
        else:
            followed = follower.before(step) if follower is not None else {}
            scalars = {**explorer.explore(stage, step), **followed}
        points = stage.control_points(step, "rollout")
        explorer.hand_over([point.version for point in points])  # colocated: sleep while the trainer trains
        with runtime.timed("sync_wait_s"):
            for point in points:
                point.meet(scalars)
                if point.publishes and not point.sends_weights:  # the trainer took no optimizer step
                    explorer.keep_weights(point.version)
                elif point.publishes:
                    scalars["timing/weight_apply_s"] = explorer.receive_weights(point.version)
        runtime.log(stage, step.global_step, scalars)
        if explorer.cfg.mode == "explore" and explorer.topology.rank == 0:  # no trainer shows the progress
            runtime.show_progress(stage, step.global_step, scalars)
        if is_eval_step(explorer.cfg, step.global_step, step.index, stage.cfg.trainer.max_steps):
            explorer.evaluate(stage, "interval", step.global_step)


def _connect_judges(cfg: RFTConfig, topology: Topology, group: ControlGroup) -> JudgeClient:
    """Reach the job's judge engines (rft/explorer/judge.py); they start while this rank's engine does."""
    from rft.explorer.judge import connect

    return connect(group.store, topology.judge_ranks // topology.judge_span, cfg.judge, cfg.sync.timeout_s)
