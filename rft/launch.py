"""`python -m rft.launch +experiment=NAME [overrides]`: compose, validate, plan, submit, watch.

    compose (Hydra) -> validate -> create generated inputs (tiny model, synthetic data)
    -> print the plan -> submit one job of T+R tasks (submitit) -> progress bar -> summary
"""

from __future__ import annotations

import os
import signal
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from rft.config import RFTConfig, register_configs, validate

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

    from rft.config import stage_configs
    from rft.report import console

    t, r = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    table = Table(title=f"rft plan: {cfg.run.name} on cluster={cfg.cluster.kind}", show_header=False)
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    table.add_row("trainer ranks", f"{list(range(t))}  (Megatron TP={tp} PP={pp} DP={t // (tp * pp)})")
    table.add_row("rollout ranks", f"{list(range(t, t + r))}  (vLLM TP={cfg.rollout.tensor_parallel_size}, "
                                   f"model {cfg.model.name})")
    table.add_row("weight sync", f"engine {cfg.sync.engine}, {cfg.sync.bucket_mb} MiB buckets, "
                                 f"timeout {cfg.sync.timeout_s:.0f}s")
    table.add_row("stages", ", ".join(f"{n}: {s.algorithm.name} x {s.trainer.max_steps} steps"
                                      for n, s in stage_configs(cfg)))
    table.add_row("output dir", cfg.run.output_dir)
    table.add_row("logs", log_dir)
    table.add_row("tensorboard", f"tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}")
    console.print(table)


def submit(cfg: RFTConfig) -> int:
    """Submit the job (submitit local or Slurm executor); follow it unless it is a Slurm job
    without `cluster.wait`. Returns the process exit code."""
    import submitit

    from rft.cluster import free_port
    from rft.job import run_rank
    from rft.monitor import write_json_atomic
    from rft.report import build_summary, console, print_summary, slurm_job_alive, watch

    log_dir = os.path.join(cfg.run.output_dir, "logs")
    print_plan(cfg, log_dir)
    world = cfg.cluster.trainer_ranks + cfg.cluster.rollout_ranks
    on_slurm = cfg.cluster.kind == "slurm"
    if on_slurm:
        import logging

        from rft.slurm import make_executor

        # submitit reads job states with sacct and warns on every poll where accounting is off;
        # rft follows the job through its result files and squeue instead
        logging.getLogger("submitit").setLevel(logging.ERROR)

        executor = make_executor(cfg, log_dir)
        port = cfg.cluster.master_port  # 0: every task derives it from the job id
    else:
        executor = submitit.AutoExecutor(folder=log_dir, cluster="local")
        executor.update_parameters(nodes=1, tasks_per_node=world, timeout_min=cfg.cluster.timeout_min,
                                   gpus_per_node=0)
        port = cfg.cluster.master_port or free_port()
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    OmegaConf.save(OmegaConf.create(config), os.path.join(cfg.run.output_dir, "config.yaml"))
    job = executor.submit(run_rank, config, port)
    console.print(f"submitted job {job.job_id} ({world} tasks)")
    if on_slurm:
        console.print(f"logs: {log_dir}/{job.job_id}_<rank>_log.out|err\n"
                      f"tensorboard: tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}",
                      soft_wrap=True)
        if not cfg.cluster.wait:
            console.print(f"follow it with `squeue -j {job.job_id}`; cancel with `scancel {job.job_id}`")
            return 0
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
    summary = build_summary(cfg.run.output_dir, world)
    write_json_atomic(os.path.join(cfg.run.output_dir, "summary.json"), summary)
    print_summary(summary)
    console.print(f"outputs: {cfg.run.output_dir}")
    return 0


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    cfg: RFTConfig = OmegaConf.to_object(dcfg)
    cfg.run.output_dir = os.path.abspath(cfg.run.output_dir)
    try:
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
    except ValueError as err:
        print(f"rft: config error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(submit(cfg))


if __name__ == "__main__":
    main()
