"""Submitting a composed run (submitit's local or Slurm executor), or a sweep as one Slurm job
array, and following it to its end: progress bar, the first failed rank, the summary."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import time

from omegaconf import OmegaConf

from rft.config import RFTConfig, buffer_dir, world_size
from rft.launch.steps import StepJob, submit_step
from rft.runtime.run_dir import Owner
from rft.runtime.topology import Topology


def _executor(cfg: RFTConfig, log_dir: str):
    """(submitit executor, rendezvous port) for cfg's cluster; port 0: each Slurm task derives it."""
    import submitit

    from rft.runtime.topology import free_port

    if cfg.cluster.kind == "slurm":
        import logging

        from rft.launch.slurm import make_executor

        # submitit reads job states with sacct and warns on every poll where accounting is off;
        # rft follows the job through its result files and squeue instead
        logging.getLogger("submitit").setLevel(logging.ERROR)
        return make_executor(cfg, log_dir), cfg.cluster.master_port
    executor = submitit.AutoExecutor(folder=log_dir, cluster="local", local_python=_task_python(cfg))
    world = world_size(cfg)
    executor.update_parameters(nodes=1, tasks_per_node=world, timeout_min=cfg.cluster.timeout_min, gpus_per_node=0)
    return executor, cfg.cluster.master_port or free_port()


def _idle_threads_sleep(cfg: RFTConfig) -> None:
    """Ranks without GPUs: OpenMP's idle threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE,
    unless set). torch's OpenMP threads spin for a while after each operation by default, and on
    cores shared with anything else (a trainer and an engine that overlap, another run or job on the
    node, CI's two workers) the spinning takes the cores the work needs: the quickstart's first 320
    steps took 270 s beside one busy core with spinning threads, 151 s without; alone 108 s against
    114 s (2-core AMD EPYC). Set here, in the launcher, because OpenMP reads it once, when torch
    loads: the ranks (and the rank server, keyed by such variables) inherit it, on Slurm through
    sbatch's exported environment."""
    if not cfg.cluster.gpus_per_node:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _task_python(cfg: RFTConfig) -> str | None:
    """The interpreter command submitit's local executor starts each task with: a client of the
    rank server (rft/runtime/rank_server.py), started here if none runs, or None (a fresh `python`)."""
    from rft.runtime import rank_server

    if cfg.cluster.rank_server_idle_min <= 0 or cfg.cluster.gpus_per_node or not rank_server.usable():
        return None
    if os.environ.get("SLURM_JOB_ID"):  # a server would outlive this run inside the job's allocation
        return None
    from rft.launch.console import console

    path = rank_server.socket_path()
    started = rank_server.ensure_server(path, cfg.cluster.rank_server_idle_min * 60)
    if started is not None:
        console.print(f"started a rank server (pid {started}): it imports torch, megatron-core and vLLM once, and "
                      f"the ranks of this and later local runs fork from it; it exits after "
                      f"{cfg.cluster.rank_server_idle_min:g} min without a run "
                      "(cluster.rank_server_idle_min; `python -m rft.runtime.rank_server stop` ends it now)",
                      soft_wrap=True, highlight=False)
    return f"{shlex.quote(sys.executable)} -m rft.runtime.rank_server run {shlex.quote(path)}"


@contextlib.contextmanager
def _output_to(path: str):
    """Point this process's stdout/stderr file descriptors at `path` for the duration, so a child
    started meanwhile inherits the file: submitit's local controller prints a KeyboardInterrupt
    traceback when a job is cancelled, which belongs in the logs, not on the user's terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def _submit_jobs(executor, cfg: RFTConfig, configs: list[dict], port: int, log_dir: str) -> list:
    from rft.runtime.task import run_rank

    if cfg.cluster.kind != "local":
        return [executor.submit(run_rank, config, port) for config in configs]
    os.makedirs(log_dir, exist_ok=True)
    with _output_to(os.path.join(log_dir, "local-controller.log")):
        return [executor.submit(run_rank, config, port) for config in configs]


def _resolved_config(cfg: RFTConfig) -> dict:
    """The config tree the ranks get, also saved as <output dir>/config.yaml."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    OmegaConf.save(OmegaConf.create(config), os.path.join(cfg.run.output_dir, "config.yaml"))
    return config


def follow(job, cfg: RFTConfig, log_dir: str) -> int:
    """Watch a submitted job to its end (progress bar, first failed rank), print its summary."""
    from rich.markup import escape

    from rft.launch.console import console
    from rft.launch.failures import where_it_ran
    from rft.launch.job_state import job_watch, local_rank_processes, stop_local_ranks, wait_until_gone
    from rft.launch.report import build_summary, print_summary, watch
    from rft.launch.tracking import draw_plots
    from rft.runtime.monitor import write_json_atomic
    from rft.runtime.pulse import SILENT_S

    world, topology = world_size(cfg), Topology.of(cfg)
    on_slurm = cfg.cluster.kind == "slurm"
    # SIGTERM (a killed launcher, a test timeout) must not orphan the ranks of a local job.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    done, alive = job_watch(job, on_slurm, cfg.run.output_dir, log_dir, world)
    failure, interrupted = None, False
    try:
        failure = watch(job, cfg.run.output_dir, log_dir, world, cfg.monitor.progress, done=done, alive=alive,
                        on_slurm=on_slurm, engine_of=losable_engines(topology), name_of=topology.member_name,
                        # its peers had their chance to time out
                        hang_s=cfg.sync.timeout_s + 2 * SILENT_S, cut_s=cfg.sync.timeout_s,
                        on_stage_end=lambda stage: draw_plots(cfg, stage))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cancel short
        interrupted = True
    finally:
        cancelled = not done()  # failed, interrupted, or over but for a lost node's ranks
        if cancelled:
            processes = [] if on_slurm else local_rank_processes(cfg.run.output_dir, log_dir, world)
            job.cancel()
            if not on_slurm:  # Slurm ends every process of a cancelled job; a local cancel does not
                # submitit's local cancel gives the ranks a Ctrl-C and a second (serve mode writes
                # the sessions rewarded since its last step then); what outlives it is killed
                deadline = time.monotonic() + 5.0
                while not done() and time.monotonic() < deadline:
                    time.sleep(0.1)
                stop_local_ranks(processes)
    if interrupted:
        console.print(f"[yellow]interrupted: job {job.job_id} cancelled; launch again with "
                      f"run.output_dir={cfg.run.output_dir} to resume from its newest checkpoint", soft_wrap=True)
    elif failure is not None and failure.stopped:
        console.print(f"[yellow]job {job.job_id} stopped: {escape(failure.stopped)}", soft_wrap=True)
    elif failure is not None:
        # the reason quotes the rank's error, which may hold brackets (gloo's "[/.../pair.cc:553]")
        # that rich would take for markup
        console.print(f"[red]rank {failure.rank} failed: {escape(failure.reason)}\n  log: {escape(failure.log_path)}",
                      soft_wrap=True)
        if on_slurm:  # which node, what else ran there, and what the rank last wrote
            for line in where_it_ran(failure, log_dir, job.job_id, world):
                console.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
        said = job.srun_said() if isinstance(job, StepJob) else ""
        if said:  # srun's own refusal, e.g. of the step's layout
            console.print(f"  srun said: {escape(said[-2000:])}", soft_wrap=True, highlight=False)
    if on_slurm and cancelled and (interrupted or failure is not None):  # not a run over but for a lost engine
        _let_ranks_save(job, log_dir, [r for r in range(world) if failure is None or r != failure.rank],
                        cfg.cluster.partition)
    if interrupted:
        return 130
    if failure is not None:
        return 1
    if on_slurm and not cancelled and not (job.wait(120) if isinstance(job, StepJob) else wait_until_gone(job.job_id)):
        console.print(f"[yellow]the ranks of job {job.job_id} finished but Slurm still lists it after 120 s")
    if cfg.mode == "serve":
        from rft.launch.report import served_line

        console.print(served_line(cfg.run.output_dir, world, buffer_dir(cfg)))
        return 0
    if cfg.mode == "bench":
        with open(os.path.join(cfg.run.output_dir, "bench.md")) as f:
            console.print(f.read(), soft_wrap=True)
        console.print(f"tables: {cfg.run.output_dir}/bench.csv, bench.md")
        return 0
    summary = build_summary(cfg.run.output_dir, world, buffer_dir(cfg))  # a decoupled job's buffer is shared
    write_json_atomic(os.path.join(cfg.run.output_dir, "summary.json"), summary)
    print_summary(summary)
    plots = [p for p in draw_plots(cfg) if p.endswith(".png")]
    if plots:
        console.print(f"plots: {', '.join(plots)} (and .svg)", soft_wrap=True, highlight=False)
    console.print(f"outputs: {cfg.run.output_dir}")
    return 0


def _let_ranks_save(job, log_dir: str, ranks: list[int], partition: str | None) -> None:
    """A cancelled Slurm job's ranks finish their step and save on scancel's SIGTERM: return once they
    have (a launch again resumes from that checkpoint), at most Slurm's KillWait, when it kills them.
    A step of an allocation (rft/launch/steps.py) gets that SIGTERM through its srun, and no
    KillWait: it is ended here after the same wait."""
    from rft.launch.console import console
    from rft.launch.job_state import wait_for_saving_ranks
    from rft.launch.slurm import kill_delays_s

    kill_wait = kill_delays_s(partition)[0]
    wait_s = (30 if kill_wait is None else kill_wait) + 5  # + slurmd's delivery of the kill
    console.print(f"[dim]job {job.job_id}: waiting up to {wait_s} s for its ranks to save and stop", highlight=False)
    step = isinstance(job, StepJob)
    if not wait_for_saving_ranks(job.job_id, log_dir, ranks, wait_s, gone=job.done if step else None):
        console.print(f"[yellow]job {job.job_id}: ranks still running after {wait_s} s; "
                      + ("ending its step" if step else "Slurm ends them (KillWait)"), highlight=False)
        if step:
            job.kill()


def losable_engines(topology: Topology) -> dict[int, int]:
    """rank -> engine index for the ranks of engines the run goes on without (rollout.on_engine_failure)."""
    if not topology.lose_engines:
        return {}
    return {rank: e for e, ranks in enumerate(topology.engine_ranks) for rank in ranks}


def submit(cfg: RFTConfig, owner: Owner, attempt: str | None) -> int:
    """Submit one run (submitit local or Slurm executor); follow it unless it is a Slurm job
    without `cluster.wait`. Returns the process exit code."""
    from rft.launch.console import console
    from rft.launch.plan import print_plan
    from rft.launch.tracking import prepare_trackers
    from rft.runtime.run_dir import set_job

    log_dir = os.path.join(cfg.run.output_dir, "logs")
    print_plan(cfg, log_dir, attempt)
    prepare_trackers(cfg)
    # a relaunch into the same dir (to resume): the old ranks' pid files would read as dead ranks
    shutil.rmtree(os.path.join(cfg.run.output_dir, "pids"), ignore_errors=True)
    _idle_threads_sleep(cfg)
    if cfg.cluster.allocation:  # inside an allocation: its step, followed to its end (rft/launch/steps.py)
        job = submit_step(cfg, _resolved_config(cfg), cfg.cluster.master_port, log_dir)
        console.print(f"started the ranks as a step of job {job.job_id} ({world_size(cfg)} tasks)\n"
                      f"logs: {log_dir}/{job.job_id}_<rank>_log.out|err", soft_wrap=True)
        return follow(job, cfg, log_dir)
    executor, port = _executor(cfg, log_dir)
    (job,) = _submit_jobs(executor, cfg, [_resolved_config(cfg)], port, log_dir)
    console.print(f"submitted job {job.job_id} ({world_size(cfg)} tasks)")
    if cfg.cluster.kind == "slurm":
        set_job(cfg.run.output_dir, owner, job.job_id)  # the job owns the directory, also after we exit
        console.print(f"logs: {log_dir}/{job.job_id}_<rank>_log.out|err\n"
                      f"tensorboard: tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}",
                      soft_wrap=True)
        if not cfg.cluster.wait:
            console.print(f"follow it with `squeue -j {job.job_id}`; cancel it with `scancel {job.job_id}`")
            return 0
    return follow(job, cfg, log_dir)


def submit_array(runs: list[tuple[RFTConfig, Owner, str | None]], sweep_dir: str) -> int:
    """Submit a Slurm sweep as one job array (task i = run i); follow every run if `cluster.wait`."""
    from rft.launch.console import console
    from rft.launch.plan import print_plan
    from rft.launch.tracking import prepare_trackers
    from rft.runtime.run_dir import release, set_job

    log_dir = os.path.join(sweep_dir, "logs")
    first = runs[0][0]
    print_plan(first, log_dir)
    for cfg, _, attempt in runs:
        prepare_trackers(cfg)
        if attempt is not None:
            console.print(f"{cfg.run.output_dir}: {attempt}", soft_wrap=True)
    _idle_threads_sleep(first)
    executor, port = _executor(first, log_dir)
    with executor.batch():
        jobs = _submit_jobs(executor, first, [_resolved_config(cfg) for cfg, _, _ in runs], port, log_dir)
    array_id = jobs[0].job_id.split("_")[0]
    world = world_size(first)
    console.print(f"submitted array job {array_id} ({len(runs)} runs x {world} tasks)")
    for job, (cfg, owner, _) in zip(jobs, runs):
        set_job(cfg.run.output_dir, owner, job.job_id)
        console.print(f"  {job.job_id}: {cfg.run.output_dir}  (logs {log_dir}/{job.job_id}_<rank>_log.out|err)",
                      soft_wrap=True)
    console.print(f"tensorboard: tensorboard --logdir {sweep_dir}", soft_wrap=True)
    if not first.cluster.wait:
        console.print(f"follow it with `squeue -j {array_id}`; cancel it with `scancel {array_id}`")
        return 0
    codes = []
    for job, (cfg, owner, _) in zip(jobs, runs):
        console.print(f"following {job.job_id} ({cfg.run.output_dir})", soft_wrap=True)
        codes.append(follow(job, cfg, log_dir))
        release(cfg.run.output_dir, owner)
    return max(codes)
