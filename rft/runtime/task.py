"""What every task of a job runs: its topology from its rank (computed once, handed to the role),
then the trainer, the explorer, a judge engine, the server or the bench."""

from __future__ import annotations

import os
import traceback
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from rft.runtime.pulse import pid_path

if TYPE_CHECKING:
    from rft.config import RFTConfig


def _roll_back_buffer(cfg, topology, resume) -> None:
    """Set aside this producer's experience written after its checkpoint (see
    ExperienceBuffer.roll_back), and return to the pool what it wrote before it but the trainer
    consumed after its own (with sync.offset the explorer saves ahead of the trainer)."""
    from rft.buffer.shards import ExperienceBuffer
    from rft.runtime.checkpoint import requeue_count

    written = resume.load(topology.rank)["progress"]["global_step"]  # shards [0, written) are in this checkpoint
    buffer = ExperienceBuffer.for_run(cfg)
    into = f"rolled_back/resume{requeue_count(cfg.run.output_dir)}-step{written:08d}"
    moved = buffer.roll_back(topology.rank, written, into)
    if moved:
        print(f"set aside {len(moved)} experience shard(s) written after the checkpoint: buffer/{into}", flush=True)
    reopened = buffer.reopen(topology.rank, resume.done)
    if reopened:
        print(f"{len(reopened)} experience shard(s) the trainer took after its checkpoint are ready again "
              f"(steps {resume.done} to {written - 1})", flush=True)


def reopen_after(cfg, done: int) -> None:
    """A decoupled trainer job starting at step `done` (rft/runtime/decoupled.py): the shards it
    took after that (trained by a killed attempt whose training no checkpoint holds) go back to
    the pool, to be trained again."""
    from rft.buffer.shards import ExperienceBuffer
    from rft.runtime.decoupled import explorer_producers

    buffer = ExperienceBuffer.for_run(cfg)
    reopened = [name for producer in explorer_producers(cfg) for name in buffer.reopen(producer, done)]
    if reopened:
        print(f"{len(reopened)} experience shard(s) an earlier attempt took after step {done} are ready again",
              flush=True)


def run_rank(config: dict, master_port: int) -> dict:
    """Entry point pickled by submitit; `config` is the resolved, validated config tree. The rank
    runs in a child process, so a kill by a signal (the OOM killer, kill -9) is reported as such
    (rft/runtime/supervisor.py)."""
    import submitit

    from rft.runtime.supervisor import run_supervised

    # The task outlives its rank by the time it takes to hand the rank's outcome to submitit
    # (unpickling an exception may import torch or vLLM: seconds): the launcher counts a rank
    # alive while either process is (rft/launch/job_state.py), so that is not mistaken for a silent death.
    path = pid_path(config["run"]["output_dir"], submitit.JobEnvironment().global_rank, supervisor=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    try:
        return run_supervised(lambda: _rank_main(config, master_port), _rank_name(config, master_port))
    except Exception as err:  # not a Ctrl-C or a cancel: the whole job is ending then
        _mark_lost(config, master_port, err)
        raise


def _mark_lost(config: dict, master_port: int, err: BaseException) -> None:
    """Tell the job's meetings at once that this voting rank is gone (rft/runtime/membership.py):
    the others then go on without an engine (rollout.on_engine_failure=continue) or fail naming
    this rank, instead of waiting out sync.timeout_s. Rank 0 hosts the store: its loss ends the job."""
    if config["mode"] in ("bench", "serve"):
        return
    try:
        _, topology = _rank_setup(config, master_port)
        if topology.rank == 0 or topology.rank not in topology.voting_ranks:
            return
        import datetime

        from rft.runtime.membership import mark_lost
        from rft.runtime.preemption import control_store

        how = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        mark_lost(control_store(topology, datetime.timedelta(seconds=3)), topology.rank, how)
    except Exception as mark_err:  # the store is gone with rank 0, or never came up: the job ends anyway
        print(f"could not mark this rank lost in the control store: {mark_err}", flush=True)


def _rank_name(config: dict, master_port: int) -> str:
    """"trainer rank 0", "rollout rank 1", "rollout rank 2 (engine 1)", "judge rank 3" (no torch
    import: the supervisor names the rank before it starts)."""
    import submitit

    from rft.runtime.topology import Topology

    env = submitit.JobEnvironment()
    rank = env.global_rank
    if config["mode"] == "bench":
        return f"bench rank {rank}"
    try:  # the roles alone: the rendezvous (a scontrol call, the gloo interface) is the rank's to resolve
        topology = Topology.of(_typed_config(config), rank)
        if env.num_tasks == topology.world_size:
            return topology.member_name(rank)
    except Exception:
        pass
    return f"rank {rank}"  # a job of the wrong size: the rank itself reports it


def _slurm_job_id() -> str | None:
    """This task's job as squeue names it: <array>_<index> for an array task, else the job id."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else os.environ.get("SLURM_JOB_ID")


def _start_over_after_requeue(cfg, resume) -> None:
    """Rank 0 of a Slurm job started again by Slurm (a requeue after a node failure) without a
    complete checkpoint: the job's earlier attempt is moved aside as a launch would, or, with
    run.resume=require, the rank stops. The other ranks wait at the control group meanwhile."""
    from rft.runtime.run_dir import has_earlier_attempt, set_aside_attempt

    if resume is not None or not has_earlier_attempt(cfg.run.output_dir):
        return
    if cfg.run.resume == "require":
        raise RuntimeError(f"{cfg.run.output_dir} holds an earlier attempt of this job but no complete checkpoint, "
                           "and run.resume=require: not starting over")
    print(f"no complete checkpoint: starting over; the earlier attempt's files are in "
          f"{set_aside_attempt(cfg.run.output_dir)}", flush=True)


def _typed_config(config: dict):
    from rft.config import RFTConfig

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RFTConfig), config))


def _rank_setup(config: dict, master_port: int):
    """The typed config and this task's Topology (the ranks its mode runs: Topology.of)."""
    from rft.runtime.topology import Topology

    cfg = _typed_config(config)
    return cfg, (None if cfg.mode == "bench" else Topology.from_env(cfg, master_port))


def _watch_engine_pulses(cfg, topology):
    """Rank 0, when the run may lose engines: a PulseWatch (rft/runtime/membership.py) that marks
    lost the engines whose node crashed or dropped off the network; None elsewhere."""
    if topology.rank != 0 or not topology.losable_ranks:
        return None
    import datetime

    from rft.runtime.membership import PulseWatch
    from rft.runtime.preemption import control_store

    store = control_store(topology, datetime.timedelta(seconds=cfg.sync.timeout_s), client=True)
    return PulseWatch(store, cfg.run.output_dir, topology.losable_ranks, topology.member_name)


def rank_threads(cfg: RFTConfig) -> int:
    """torch's intra-op threads for a rank: trainer.threads, else the cores this process may run on
    (its CPU set: a Slurm task's cpus_per_task, a taskset; not the node's count, which oversubscribed
    a task confined to a few cores). Roles take turns when synchronous; with sync.offset or
    sync.free_run they run at once and would oversubscribe shared cores (measured on 2 cores,
    tools/bench_async.py: all cores each 0.72 s/step, half 0.33)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cfg.trainer.threads or max(1, cores // 2 if cfg.sync.offset or cfg.sync.free_run else cores)


def _rank_main(config: dict, master_port: int) -> dict:
    from rft.runtime.rendezvous import host_address, this_node, wait_until_reachable
    from rft.runtime.topology import engine_devices, init_trainer_group, rank_devices

    cfg, topology = _rank_setup(config, master_port)
    if cfg.mode == "bench":  # one rollout task, no trainer, no weight sync
        from rft.explorer.bench import run_bench

        return run_bench(cfg)
    os.makedirs(os.path.dirname(pid_path(cfg.run.output_dir, topology.rank)), exist_ok=True)
    with open(pid_path(cfg.run.output_dir, topology.rank), "w") as f:
        f.write(str(os.getpid()))
    from rft.runtime.pulse import Pulse

    pulse = Pulse(pid_path(cfg.run.output_dir, topology.rank))  # the launcher tells a stopped rank by it
    devices = rank_devices(cfg.cluster, topology)
    print(f"rank {topology.rank}/{topology.world_size}: {topology.role} (role rank {topology.role_rank}) on "
          f"{this_node()} ({host_address(topology.master_addr)}), "
          f"rank 0 at {topology.master_addr}:{topology.master_port}" + (f", GPU {devices}" if devices else ""), flush=True)
    if topology.rank != 0 and topology.master_node:  # fail in seconds, not sync.timeout_s, if it is unreachable
        wait_until_reachable(topology.master_addr, topology.control_port, topology.master_node)
        pulse.reach = (topology.master_addr, topology.control_port)  # and a partition is named by it
    import torch

    torch.set_num_threads(rank_threads(cfg))
    from rft.runtime.checkpoint import newest_complete
    from rft.runtime.preemption import ControlGroup, StopFlag, hold_until_finished

    try:
        stop = StopFlag()
        stop.install()  # replaces submitit's requeue-on-SIGUSR2: every rank must save first
        if topology.is_judge_follower:
            return hold_until_finished(topology)
        if topology.role == "judge":  # a frozen engine rewards ask; no state, no votes (rft/explorer/judge_rank.py)
            from rft.explorer.judge_rank import run_judge

            return run_judge(cfg, topology)
        if cfg.mode == "serve":  # no tasks, no trainer, no checkpoints: sessions in, shards out
            from rft.explorer.serve import run_server

            return run_server(cfg, topology, ControlGroup(topology, topology.voting_ranks, cfg.sync.timeout_s), stop)
        resume = newest_complete(cfg.run.output_dir, topology.voting_ranks)
        job_id = _slurm_job_id() if cfg.cluster.kind == "slurm" else None  # (a local run may sit in an salloc)
        if topology.rank == 0 and job_id is not None:  # a requeue finds its own job in owner.json
            from rft.runtime.run_dir import check_job_owns

            check_job_owns(cfg.run.output_dir, job_id)
            _start_over_after_requeue(cfg, resume)
        if resume is not None:
            print(f"resuming from {resume.step_dir} ({resume.done} steps done)", flush=True)
            if topology.role == "rollout" and not cfg.sync.decoupled:  # a decoupled explorer keeps its shards
                _roll_back_buffer(cfg, topology, resume)
        if cfg.sync.decoupled and topology.rank == 0 and topology.role == "trainer":
            reopen_after(cfg, resume.done if resume is not None else 0)
        if topology.is_engine_follower:
            return hold_until_finished(topology)
        if topology.role == "rollout" and cfg.cluster.gpus_per_node:
            os.environ["CUDA_VISIBLE_DEVICES"] = engine_devices(cfg.cluster, topology.engine_span)  # this group's GPUs, for vLLM
        # every rank meets here, so no trainer claims experience before the rollback above
        control = ControlGroup(topology, topology.voting_ranks, cfg.sync.timeout_s, topology.member_name,
                               topology.losable_ranks)
        from rft.runtime.rendezvous import check_run_dir_shared

        check_run_dir_shared(control.store, topology.rank, cfg.run.output_dir)
        pulses = _watch_engine_pulses(cfg, topology)
        if topology.role == "trainer":
            from rft.trainer.trainer import run_trainer

            init_trainer_group(topology, cfg.sync.timeout_s)
            summary = run_trainer(cfg, topology, control, stop, resume)
        else:
            from rft.explorer.rollout_rank import run_explorer

            summary = run_explorer(cfg, topology, control, stop, resume)
        # the last meeting: rank 0 hosts the store the engines deal tasks through until every
        # rank is done (the engines' final evaluation comes after the trainer's last step)
        if pulses is not None:
            pulses.stop()
        control.any(False)
        if topology.rank == 0:
            control.finish()
        return summary
    except BaseException:
        traceback.print_exc()
        raise
