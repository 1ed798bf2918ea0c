"""`python -m rft.launch +experiment=NAME [overrides]`: compose, validate, plan, submit, watch.

    compose (Hydra) -> validate -> own the run directory, resume or start over
    -> create generated inputs (tiny model, synthetic data) -> print the plan
    -> submit one job of T+R tasks (submitit) -> progress bar -> summary
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rft.config import RFTConfig, config_error, register_configs, world_size
from rft.config_checks import validate
from rft.runtime.run_dir import Owner

register_configs()


def prepare(cfg: RFTConfig) -> None:
    """Create what the config says to generate: the tiny model and synthetic tasksets (of the top
    level, and of every stage that sets its own generator: rft.config.generated_data)."""
    from rft.data.arithmetic import write_arithmetic_tasksets
    from rft.config import generated_data
    from rft.explorer.envs import write_env_tasksets

    os.makedirs(cfg.run.output_dir, exist_ok=True)
    for section in generated_data(cfg):
        data = section.data
        if data.from_env is not None:
            write_env_tasksets(section.rollout.env, data.from_env, data.train_path, data.eval_path, cfg.seed)
        else:
            write_arithmetic_tasksets(data.arithmetic, data.train_path, data.eval_path, cfg.seed)
    if cfg.model.tiny is not None:
        from rft.models.tiny import create_tiny_model

        create_tiny_model(cfg.model.tiny, cfg.model.path, cfg.seed)


def saving_ranks(cfg: RFTConfig) -> list[int]:
    """The ranks whose files make a checkpoint complete, in the ranks this mode starts (rft/job.py)."""
    from rft.cluster import voting_ranks

    t, r = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    saving_t = 0 if cfg.mode == "explore" else t
    return voting_ranks(cfg, saving_t, saving_t + (0 if cfg.mode == "train" else r))


def start_or_resume(cfg: RFTConfig) -> str | None:
    """What this launch does with an earlier attempt in run.output_dir (rft/runtime/run_dir.py):
    resume from its newest complete checkpoint, or start over with its files moved to
    <run>/attempts/<n>. Raises ValueError (a finished run with `run.resume=auto`, or
    `run.resume=require` and nothing to resume). Returns the plan's line about it, or None for a fresh directory."""
    from rft.checkpoint import newest_complete
    from rft.runtime.run_dir import finished, has_earlier_attempt, next_attempt_dir, set_aside_attempt

    run_dir, policy = cfg.run.output_dir, cfg.run.resume
    if not has_earlier_attempt(run_dir):
        return None
    resume = newest_complete(run_dir, saving_ranks(cfg))
    if policy == "auto" and finished(run_dir):
        config_error("run.output_dir", run_dir,
                     f"holds a finished run (summary.json); launch into a new run.output_dir, start it over with "
                     f"run.resume=never (the finished run is kept in {next_attempt_dir(run_dir)}), or train its "
                     "last steps again from its newest checkpoint with run.resume=require")
    if policy != "never" and resume is not None:
        refuse_another_layout(cfg, next_attempt_dir(run_dir))
        return f"resume from {resume.step_dir} ({resume.done} steps done)"
    if policy == "require":
        config_error("run.resume", policy,
                     f"{run_dir} holds an earlier attempt but no complete checkpoint to resume from; "
                     f"run.resume=auto starts it over (the earlier attempt kept in {next_attempt_dir(run_dir)}), "
                     "or launch into a new run.output_dir")
    why = "run.resume=never" if policy == "never" else "no complete checkpoint to resume from"
    return f"start over ({why}); the earlier attempt's files are in {set_aside_attempt(run_dir)}"


# what the trainer's checkpoint files are laid out by (rft/checkpoint.py: one file per rank, Megatron
# shards under their parameter names, LoRA adapters of the stage's rank): a resume keeps each
CHECKPOINT_LAYOUT = ("cluster.trainer_ranks", "trainer.tensor_parallel_size", "trainer.pipeline_parallel_size",
                     "trainer.virtual_pipeline_stages", "trainer.transformer_impl")


def refuse_another_layout(cfg: RFTConfig, attempt_dir: str) -> None:
    """A relaunch that would resume a checkpoint into another layout is refused here, naming the
    key, instead of failing in every rank's load_state_dict. Compares with the config the earlier
    launch saved (<run>/config.yaml); what that config lacks (an older rft) is not compared."""
    from rft.config import stage_configs

    path = os.path.join(cfg.run.output_dir, "config.yaml")
    if not os.path.exists(path):
        return
    saved, now = OmegaConf.load(path), OmegaConf.structured(cfg)
    changed = [(key, OmegaConf.select(saved, key), OmegaConf.select(now, key)) for key in CHECKPOINT_LAYOUT]
    with contextlib.suppress(Exception):  # a config an older rft saved may not fit today's schema
        earlier = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RFTConfig), saved))
        ranks = {name: stage.trainer.lora.rank for name, stage in stage_configs(earlier)}
        changed += [(f"stages[{name}].trainer.lora.rank", ranks.get(name), stage.trainer.lora.rank)
                    for name, stage in stage_configs(cfg)]
    for key, before, after in changed:
        if before is not None and before != after:
            config_error(key, after, f"the checkpoint in run.output_dir={cfg.run.output_dir} was saved with "
                         f"{key}={before}, and a checkpoint resumes only into the layout it was saved from: "
                         f"launch with {key}={before}, start over with run.resume=never (the earlier attempt "
                         f"kept in {attempt_dir}), or launch into a new run.output_dir")


def print_plan(cfg: RFTConfig, log_dir: str, attempt: str | None = None) -> None:
    from rich.table import Table

    from rft.config import context_length, stage_configs
    from rft.console import console

    t, r = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    table = Table(title=f"rft plan: {cfg.run.name} on cluster={cfg.cluster.kind}", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # long paths wrap, never cut to "..." (logs are 80 columns wide)
    if cfg.mode == "bench":
        from rft.bench import bench_checkpoints

        table.add_row("mode", f"bench: pass@k / mean@k for k in {list(cfg.bench.k)} on {cfg.data.eval_path}")
        table.add_row("checkpoints", "\n".join(bench_checkpoints(cfg)))
        table.add_row("output dir", cfg.run.output_dir)
        if attempt is not None:
            table.add_row("attempt", attempt)
        console.print(table)
        return
    if cfg.mode == "serve":
        table.add_row("mode", "serve: vLLM's OpenAI API on every engine; rewarded sessions -> <run>/buffer every "
                              f"{cfg.serve.step_s:g}s" + (f", for {cfg.serve.duration_min:g} min" if cfg.serve.duration_min
                                                        else ", until cancelled"))
        table.add_row("engines", engines_line(cfg))
        table.add_row("weights", f"{cfg.model.path}, then each version a trainer publishes to {cfg.sync.checkpoint_dir}"
                      if cfg.sync.checkpoint_dir else f"{cfg.model.path} (fixed; set sync.checkpoint_dir to follow "
                                                       "a trainer's sync.engine=checkpoint)")
        table.add_row("output dir", cfg.run.output_dir)
        table.add_row("logs", log_dir)
        console.print(table)
        return
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    table.add_row("trainer ranks", f"{list(range(t))}  (Megatron TP={tp} PP={pp} DP={t // (tp * pp)})")
    table.add_row("rollout ranks", f"{list(range(t, t + r))}  (vLLM TP={cfg.rollout.tensor_parallel_size}, "
                                   f"model {cfg.model.name})")
    if cfg.mode in ("both", "explore") and r:
        table.add_row("engines", engines_line(cfg))
    if cfg.mode in ("both", "explore") and cfg.cluster.judge_ranks:
        first = t + r if cfg.mode == "both" else r
        table.add_row("judge ranks", f"{list(range(first, first + cfg.cluster.judge_ranks))}  (frozen vLLM, "
                                     f"TP={cfg.judge.tensor_parallel_size}, model {cfg.judge.model or cfg.model.path}; "
                                     f"calls time out after {cfg.judge.timeout_s:g}s)")
    table.add_row("weight sync", f"engine {cfg.sync.engine}, {cfg.sync.bucket_mb} MiB buckets, "
                                 f"timeout {cfg.sync.timeout_s:.0f}s")
    if cfg.mode == "both":
        table.add_row("schedule", schedule_line(cfg))
    context, stages = context_length(cfg.model), stage_configs(cfg)
    table.add_row("stages", ", ".join(f"{n}: {s.algorithm.name} x {s.trainer.max_steps} steps" for n, s in stages))
    # a packed microbatch holds its budget, or one row up to the context if a row is longer
    tokens = max(max(s.trainer.max_tokens_per_microbatch, context) if s.trainer.max_tokens_per_microbatch
                 else max(s.trainer.micro_batch_size, 1) * context for _, s in stages)
    table.add_row("sequences", f"<= {context} tokens (prompt + response; longer rows: data.overlong="
                               f"{cfg.data.overlong}); a trainer microbatch <= {tokens} tokens")
    if cfg.mode != "explore":
        save = [f"every {cfg.trainer.save_every_min:g} min"] if cfg.trainer.save_every_min else []
        save += [f"every {cfg.trainer.save_interval} steps"] if cfg.trainer.save_interval else []
        table.add_row("checkpoints", " and ".join(save + ["on Slurm's time-limit signal"]) + ", "
                      f"newest {cfg.trainer.keep_checkpoints} kept")
    table.add_row("output dir", cfg.run.output_dir)
    if attempt is not None:
        table.add_row("attempt", attempt)
    table.add_row("logs", log_dir)
    table.add_row("tensorboard", f"tensorboard --logdir {os.path.join(cfg.run.output_dir, 'tensorboard')}")
    console.print(table)


def engines_line(cfg: RFTConfig) -> str:
    """One line per vLLM engine: its ranks and the node of the allocation they run on."""
    from rft.cluster import engine_ranks
    from rft.slurm import tasks_per_node

    per_node = tasks_per_node(cfg) if cfg.cluster.kind == "slurm" else None
    lines = []
    for e, ranks in enumerate(engine_ranks(cfg)):
        where = f"node {ranks[0] // per_node} of {cfg.cluster.nodes}" if per_node else "this machine"
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        lines.append(f"engine {e}: {span} on {where}")
    deal = "tasks dealt by load" if len(lines) > 1 else "one engine"
    return "\n".join(lines) + f"\n({deal}; each writes its own shards)"


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
    from rft.job import run_rank

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


def rank_name(cfg: RFTConfig, rank: int) -> str:
    """A rank as the launcher names it: "trainer rank 1", "rollout rank 2", "judge rank 3"."""
    trainers, rollouts = cfg.cluster.trainer_ranks, cfg.cluster.rollout_ranks
    role = "trainer" if rank < trainers else "rollout" if rank < trainers + rollouts else "judge"
    return f"{role} rank {rank}"


def follow(job, cfg: RFTConfig, log_dir: str) -> int:
    """Watch a submitted job to its end (progress bar, first failed rank), print its summary."""
    from rich.markup import escape

    from rft.monitor import write_json_atomic
    from rft.runtime.pulse import SILENT_S
    from rft.console import console
    from rft.job_state import job_watch, local_rank_processes, stop_local_ranks, wait_until_gone
    from rft.report import build_summary, print_summary, watch

    world = world_size(cfg)
    on_slurm = cfg.cluster.kind == "slurm"
    # SIGTERM (a killed launcher, a test timeout) must not orphan the ranks of a local job.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    done, alive = job_watch(job, on_slurm, cfg.run.output_dir, log_dir, world)
    try:
        failure = watch(job, cfg.run.output_dir, log_dir, world, cfg.monitor.progress, done=done, alive=alive,
                        on_slurm=on_slurm, engine_of=losable_engines(cfg), name_of=lambda rank: rank_name(cfg, rank),
                        hang_s=cfg.sync.timeout_s + 2 * SILENT_S)  # its peers had their chance to time out
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cancel short
        console.print(f"[yellow]interrupted: job {job.job_id} cancelled; launch again with "
                      f"run.output_dir={cfg.run.output_dir} to resume from its newest checkpoint", soft_wrap=True)
        return 130
    finally:
        if not done():
            processes = [] if on_slurm else local_rank_processes(cfg.run.output_dir, log_dir, world)
            job.cancel()
            if not on_slurm:  # Slurm ends every process of a cancelled job; a local cancel does not
                # submitit's local cancel gives the ranks a Ctrl-C and a second (serve mode writes
                # the sessions rewarded since its last step then); what outlives it is killed
                deadline = time.monotonic() + 5.0
                while not done() and time.monotonic() < deadline:
                    time.sleep(0.1)
                stop_local_ranks(processes)
    if failure is not None:
        # the reason quotes the rank's error, which may hold brackets (gloo's "[/.../pair.cc:553]")
        # that rich would take for markup
        console.print(f"[red]rank {failure.rank} failed: {escape(failure.reason)}\n  log: {escape(failure.log_path)}",
                      soft_wrap=True)
        return 1
    if on_slurm and not wait_until_gone(job.job_id):
        console.print(f"[yellow]the ranks of job {job.job_id} finished but Slurm still lists it after 120 s")
    if cfg.mode == "serve":
        from rft.report import served_line

        console.print(served_line(cfg.run.output_dir, world))
        return 0
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


def losable_engines(cfg: RFTConfig) -> dict[int, int]:
    """rank -> engine index for the ranks of engines the run goes on without (rollout.on_engine_failure)."""
    from rft.cluster import engine_ranks

    if cfg.rollout.on_engine_failure != "continue":
        return {}
    return {rank: e for e, ranks in enumerate(engine_ranks(cfg)) for rank in ranks}


def submit(cfg: RFTConfig, owner: Owner, attempt: str | None) -> int:
    """Submit one run (submitit local or Slurm executor); follow it unless it is a Slurm job
    without `cluster.wait`. Returns the process exit code."""
    from rft.console import console
    from rft.runtime.run_dir import set_job

    log_dir = os.path.join(cfg.run.output_dir, "logs")
    print_plan(cfg, log_dir, attempt)
    # a relaunch into the same dir (to resume): the old ranks' pid files would read as dead ranks
    shutil.rmtree(os.path.join(cfg.run.output_dir, "pids"), ignore_errors=True)
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
    from rft.console import console
    from rft.runtime.run_dir import release, set_job

    log_dir = os.path.join(sweep_dir, "logs")
    first = runs[0][0]
    print_plan(first, log_dir)
    for cfg, _, attempt in runs:
        if attempt is not None:
            console.print(f"{cfg.run.output_dir}: {attempt}", soft_wrap=True)
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


def _missing_key_message(err: MissingMandatoryValue) -> str:
    """`model.path must be set` with the key's doc and the command line to run, instead of
    omegaconf's exception."""
    from rft.config import field_doc

    key = err.full_key
    doc = field_doc(key)
    example = {"model.path": "/path/to/hf_model"}.get(key, "<value>")
    command = " ".join(["python -m rft.launch", *sys.argv[1:], f"{key}={example}"])
    hint = ("\n  (SmolLM2-135M on CPU: run `python tools/prepare_smollm2.py` once, then pass `model=smollm2_135m`)"
            if key == "model.path" else "")
    return f"{key} must be set{f' ({doc})' if doc else ''}: add it to the command line, e.g.\n  {command}{hint}"


def configure(dcfg: DictConfig, multirun: bool) -> RFTConfig:
    """Compose -> typed config, cluster kind and GPUs resolved, validated and checked against the
    cluster. Raises ValueError naming the key on a bad config."""
    from hydra.core.hydra_config import HydraConfig

    if multirun and not any(o.split("=")[0].lstrip("+~") == "run.output_dir"
                            for o in HydraConfig.get().overrides.task):
        # each sweep run writes to its own <sweep dir>/<n> (set before resolving: data paths
        # interpolate it)
        with open_dict(dcfg):
            dcfg.run.output_dir = HydraConfig.get().runtime.output_dir
    if dcfg.get("mode") == "serve" and OmegaConf.is_missing(dcfg.data, "train_path"):
        with open_dict(dcfg):
            dcfg.data.train_path = ""  # serving reads no taskset: nothing to ask the user for
    try:
        cfg: RFTConfig = OmegaConf.to_object(dcfg)
    except MissingMandatoryValue as err:
        raise ValueError(_missing_key_message(err)) from None
    except OmegaConfBaseException as err:  # a bad interpolation, a value of the wrong type
        key = getattr(err, "full_key", None)
        raise ValueError(f"{key + ': ' if key else ''}{str(err).splitlines()[0]}") from None
    cfg.run.output_dir = os.path.abspath(cfg.run.output_dir)
    from rft.slurm import check_against_cluster, check_request, resolve_gpus, resolve_kind

    if cfg.cluster.kind == "auto":
        cfg.cluster.kind = resolve_kind(cfg.cluster)
        print(f"rft: cluster=auto -> {cfg.cluster.kind} "
              f"({'a Slurm controller answers' if cfg.cluster.kind == 'slurm' else 'no Slurm controller answers'})")
    note = resolve_gpus(cfg)
    if note:
        print(f"rft: {note}")
    validate(cfg)  # generated inputs (tiny model, synthetic data) are exempt from path checks
    if cfg.cluster.kind == "slurm":
        check_request(cfg)
        check_against_cluster(cfg)
    return cfg


def take_run_dir(cfg: RFTConfig) -> tuple[Owner, str | None]:
    """Own run.output_dir (RunDirBusy if another live launch does), decide between resuming and
    starting over, then create the generated inputs. Releases the directory if a step fails."""
    from rft.runtime.run_dir import claim, release, this_launch

    owner = this_launch(cfg.cluster.kind)
    took_over = claim(cfg.run.output_dir, owner)
    if took_over:
        print(f"rft: {took_over}")
    try:
        attempt = None if cfg.mode == "serve" else start_or_resume(cfg)  # serving goes on after its last shard
        prepare(cfg)
    except BaseException:
        release(cfg.run.output_dir, owner)
        raise
    return owner, attempt


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rft import sweep
    from rft.runtime.run_dir import release

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        cfg = configure(dcfg, multirun)
        owner, attempt = take_run_dir(cfg)
    except ValueError as err:  # RunDirBusy included
        print(f"rft: config error: {err}", file=sys.stderr)
        sys.exit(2)  # in a sweep: before anything was submitted to Slurm
    if multirun and cfg.cluster.kind == "slurm":
        sweep.QUEUED.append((cfg, owner, attempt))  # submitted as one array when the sweep ends (rft/sweep.py)
        print(f"rft: sweep run {len(sweep.QUEUED) - 1} -> {cfg.run.output_dir}")
        return
    try:
        code = submit(cfg, owner, attempt)
    finally:
        if cfg.cluster.kind == "local" or cfg.cluster.wait:
            release(cfg.run.output_dir, owner)  # else the Slurm job owns it while it is queued or runs
    if not multirun:
        sys.exit(code)
    sweep.EXIT_CODES.append(code)


if __name__ == "__main__":
    main()
