"""`python -m rft.launch +experiment=NAME [overrides]`: compose, validate, plan, submit, watch.

    compose (Hydra) -> validate -> create generated inputs (tiny model, synthetic data)
    -> print the plan -> submit one job of T+R tasks (submitit) -> progress bar -> summary
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from rft.config import RFTConfig, register_configs, validate, world_size

register_configs()


def prepare(cfg: RFTConfig) -> None:
    """Create what the config says to generate: the tiny model and synthetic tasksets."""
    from rft.buffer.arithmetic import write_arithmetic_tasksets

    os.makedirs(cfg.run.output_dir, exist_ok=True)
    if cfg.data.arithmetic is not None:
        write_arithmetic_tasksets(cfg.data.arithmetic, cfg.data.train_path, cfg.data.eval_path, cfg.seed)
    if cfg.model.tiny is not None:
        from rft.models.tiny import create_tiny_model

        create_tiny_model(cfg.model.tiny, cfg.model.path, cfg.seed)


def print_plan(cfg: RFTConfig, log_dir: str) -> None:
    from rich.table import Table

    from rft.checkpoint import newest_complete
    from rft.cluster import voting_ranks
    from rft.config import stage_configs
    from rft.report import console

    t, r = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    table = Table(title=f"rft plan: {cfg.run.name} on cluster={cfg.cluster.kind}", show_header=False)
    if cfg.mode == "bench":
        from rft.bench import bench_checkpoints

        table.add_row("mode", f"bench: pass@k / mean@k for k in {list(cfg.bench.k)} on {cfg.data.eval_path}")
        table.add_row("checkpoints", "\n".join(bench_checkpoints(cfg)))
        table.add_row("output dir", cfg.run.output_dir)
        console.print(table)
        return
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    table.add_row("trainer ranks", f"{list(range(t))}  (Megatron TP={tp} PP={pp} DP={t // (tp * pp)})")
    table.add_row("rollout ranks", f"{list(range(t, t + r))}  (vLLM TP={cfg.rollout.tensor_parallel_size}, "
                                   f"model {cfg.model.name})")
    table.add_row("weight sync", f"engine {cfg.sync.engine}, {cfg.sync.bucket_mb} MiB buckets, "
                                 f"timeout {cfg.sync.timeout_s:.0f}s")
    if cfg.mode == "both":
        table.add_row("schedule", schedule_line(cfg))
    table.add_row("stages", ", ".join(f"{n}: {s.algorithm.name} x {s.trainer.max_steps} steps"
                                      for n, s in stage_configs(cfg)))
    table.add_row("output dir", cfg.run.output_dir)
    saving_t = 0 if cfg.mode == "explore" else t  # the ranks rft/job.py starts in this mode
    saving = voting_ranks(cfg, saving_t, saving_t + (0 if cfg.mode == "train" else r))
    resume = newest_complete(cfg.run.output_dir, saving)
    if resume is not None:
        table.add_row("resume", f"from {resume.step_dir} ({resume.done} steps done)")
    table.add_row("logs", log_dir)
    table.add_row("tensorboard", f"tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}")
    console.print(table)


def schedule_line(cfg: RFTConfig) -> str:
    """How explorer and trainer interleave in rollout stages (rft/schedule.py), and the staleness
    that allows, with a warning where buffer.max_staleness will drop or re-weight shards by design."""
    from rft.schedule import max_lag

    k, n, limit = cfg.sync.offset, cfg.sync.interval, cfg.buffer.max_staleness
    kind = "synchronous on-policy" if k == 0 and n == 1 else ("one-step-off" if (k, n) == (1, 1) else "asynchronous")
    line = f"{kind}: weights sync every {n} step(s), explorer {k} step(s) ahead; experience up to {max_lag(cfg)} " \
           "trainer step(s) old"
    if limit is not None:
        line += f"; older than {limit}: {cfg.buffer.stale}"
        if limit < max_lag(cfg):
            line += " [yellow](every sync window: sync.offset + sync.interval - 1 > buffer.max_staleness)[/yellow]"
    return line


def _executor(cfg: RFTConfig, log_dir: str):
    """(submitit executor, rendezvous port) for cfg's cluster; port 0: each Slurm task derives it."""
    import submitit

    from rft.cluster import free_port

    if cfg.cluster.kind == "slurm":
        import logging

        from rft.slurm import make_executor

        # submitit reads job states with sacct and warns on every poll where accounting is off;
        # rft follows the job through its result files and squeue instead
        logging.getLogger("submitit").setLevel(logging.ERROR)
        return make_executor(cfg, log_dir), cfg.cluster.master_port
    executor = submitit.AutoExecutor(folder=log_dir, cluster="local")
    world = world_size(cfg)
    executor.update_parameters(nodes=1, tasks_per_node=world, timeout_min=cfg.cluster.timeout_min, gpus_per_node=0)
    return executor, cfg.cluster.master_port or free_port()


def _resolved_config(cfg: RFTConfig) -> dict:
    """The config tree the ranks get, also saved as <output dir>/config.yaml."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    OmegaConf.save(OmegaConf.create(config), os.path.join(cfg.run.output_dir, "config.yaml"))
    return config


def follow(job, cfg: RFTConfig, log_dir: str) -> int:
    """Watch a submitted job to its end (progress bar, first failed rank), print its summary."""
    from rft.monitor import write_json_atomic
    from rft.report import build_summary, console, print_summary, slurm_job_alive, wait_until_gone, watch

    world = world_size(cfg)
    on_slurm = cfg.cluster.kind == "slurm"
    # SIGTERM (a killed launcher, a test timeout) must not orphan the ranks of a local job.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        failure = watch(job, cfg.run.output_dir, log_dir, world, cfg.monitor.progress,
                        alive=slurm_job_alive(job.job_id) if on_slurm else None)
    finally:
        if not job.done():
            job.cancel()
    if failure is not None:
        console.print(f"[red]rank {failure.rank} failed: {failure.reason}\n  log: {failure.log_path}", soft_wrap=True)
        return 1
    if on_slurm and not wait_until_gone(job.job_id):
        console.print(f"[yellow]the ranks of job {job.job_id} finished but Slurm still lists it after 120 s")
    if cfg.mode == "bench":
        with open(os.path.join(cfg.run.output_dir, "bench.md")) as f:
            console.print(f.read(), soft_wrap=True)
        console.print(f"tables: {cfg.run.output_dir}/bench.csv, bench.md")
        return 0
    summary = build_summary(cfg.run.output_dir, world)
    write_json_atomic(os.path.join(cfg.run.output_dir, "summary.json"), summary)
    print_summary(summary)
    console.print(f"outputs: {cfg.run.output_dir}")
    return 0


def submit(cfg: RFTConfig) -> int:
    """Submit one run (submitit local or Slurm executor); follow it unless it is a Slurm job
    without `cluster.wait`. Returns the process exit code."""
    from rft.job import run_rank
    from rft.report import console

    log_dir = os.path.join(cfg.run.output_dir, "logs")
    print_plan(cfg, log_dir)
    # a relaunch into the same dir (to resume): the old ranks' pid files would read as dead ranks
    shutil.rmtree(os.path.join(cfg.run.output_dir, "pids"), ignore_errors=True)
    executor, port = _executor(cfg, log_dir)
    job = executor.submit(run_rank, _resolved_config(cfg), port)
    console.print(f"submitted job {job.job_id} ({world_size(cfg)} tasks)")
    if cfg.cluster.kind == "slurm":
        console.print(f"logs: {log_dir}/{job.job_id}_<rank>_log.out|err\n"
                      f"tensorboard: tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}",
                      soft_wrap=True)
        if not cfg.cluster.wait:
            console.print(f"follow it with `squeue -j {job.job_id}`; cancel with `scancel {job.job_id}`")
            return 0
    return follow(job, cfg, log_dir)


def submit_array(runs: list[RFTConfig], sweep_dir: str) -> int:
    """Submit a Slurm sweep as one job array (task i = run i); follow every run if `cluster.wait`."""
    from rft.job import run_rank
    from rft.report import console

    log_dir = os.path.join(sweep_dir, "logs")
    print_plan(runs[0], log_dir)
    executor, port = _executor(runs[0], log_dir)
    with executor.batch():
        jobs = [executor.submit(run_rank, _resolved_config(run), port) for run in runs]
    array_id = jobs[0].job_id.split("_")[0]
    world = world_size(runs[0])
    console.print(f"submitted array job {array_id} ({len(runs)} runs x {world} tasks)")
    for job, run in zip(jobs, runs):
        console.print(f"  {job.job_id}: {run.run.output_dir}  (logs {log_dir}/{job.job_id}_<rank>_log.out|err)",
                      soft_wrap=True)
    console.print(f"tensorboard: tensorboard --logdir {sweep_dir}", soft_wrap=True)
    if not runs[0].cluster.wait:
        console.print(f"follow it with `squeue -j {array_id}`; cancel with `scancel {array_id}`")
        return 0
    codes = []
    for job, run in zip(jobs, runs):
        console.print(f"following {job.job_id} ({run.run.output_dir})", soft_wrap=True)
        codes.append(follow(job, run, log_dir))
    return max(codes)


def configure(dcfg: DictConfig, multirun: bool) -> RFTConfig:
    """Compose -> typed config, cluster kind resolved, validated and checked, inputs generated.
    Raises ValueError naming the key on a bad config."""
    from hydra.core.hydra_config import HydraConfig

    if multirun and not any(o.split("=")[0].lstrip("+~") == "run.output_dir"
                            for o in HydraConfig.get().overrides.task):
        # each sweep run writes to its own <sweep dir>/<n> (set before resolving: data paths
        # interpolate it)
        with open_dict(dcfg):
            dcfg.run.output_dir = HydraConfig.get().runtime.output_dir
    cfg: RFTConfig = OmegaConf.to_object(dcfg)
    cfg.run.output_dir = os.path.abspath(cfg.run.output_dir)
    from rft.slurm import check_against_cluster, check_request, resolve_kind

    if cfg.cluster.kind == "auto":
        cfg.cluster.kind = resolve_kind(cfg.cluster)
        print(f"rft: cluster=auto -> {cfg.cluster.kind} "
              f"({'a Slurm controller answers' if cfg.cluster.kind == 'slurm' else 'no Slurm controller answers'})")
    validate(cfg)  # generated inputs (tiny model, synthetic data) are exempt from path checks
    if cfg.cluster.kind == "slurm":
        check_request(cfg)
        check_against_cluster(cfg)
    prepare(cfg)
    return cfg


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rft import sweep

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        cfg = configure(dcfg, multirun)
    except ValueError as err:
        print(f"rft: config error: {err}", file=sys.stderr)
        sys.exit(2)  # in a sweep: before anything was submitted to Slurm
    if multirun and cfg.cluster.kind == "slurm":
        sweep.QUEUED.append(cfg)  # submitted as one array when the sweep ends (rft/sweep.py)
        print(f"rft: sweep run {len(sweep.QUEUED) - 1} -> {cfg.run.output_dir}")
        return
    code = submit(cfg)
    if not multirun:
        sys.exit(code)
    sweep.EXIT_CODES.append(code)


if __name__ == "__main__":
    main()
