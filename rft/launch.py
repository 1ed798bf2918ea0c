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

from rft.config import RFTConfig, register_configs, world_size
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
    from rft.plan import print_plan
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
    from rft.plan import print_plan
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
    from rft.attempts import start_or_resume
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


# Sections that are null unless a config sets them (Optional[...] in rft/config.py), and a config
# that sets each
UNSET_SECTIONS = {"model.tiny": "conf/model/tiny_qwen2.yaml", "data.arithmetic": "conf/experiment/quickstart.yaml",
                  "data.from_env": "conf/experiment/quickstart_agent.yaml"}


@contextlib.contextmanager
def null_section_errors(args: list[str]):
    """An override of a key inside a section the composed config leaves null
    (`data.from_env.num_train=3` where data.from_env is null) makes OmegaConf fail an assert while
    Hydra composes, and Hydra prints the whole traceback. For command lines that set such a key,
    Hydra is told to raise instead (HYDRA_FULL_ERROR): that failure becomes a config error naming
    the override and what to write, and any other error goes back to Hydra's own report."""
    if "HYDRA_FULL_ERROR" in os.environ or not any(
            arg.lstrip("+~").startswith(tuple(f"{s}." for s in UNSET_SECTIONS)) for arg in args):
        yield
        return
    from hydra._internal.utils import run_and_report

    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as err:
        del os.environ["HYDRA_FULL_ERROR"]
        override = _override_being_applied(err)
        if override is None or not isinstance(err, (AssertionError, AttributeError)):
            run_and_report(lambda: _raise(err))  # prints as Hydra does and exits 1
        section, _, leaf = override.key_or_group.rpartition(".")
        top, _, inner = section.partition(".")
        example = f" ({UNSET_SECTIONS[section]} sets {section})" if section in UNSET_SECTIONS else ""
        print(f"rft: config error: {override.input_line}: {section} is null in this config, so it has no {leaf} "
              f"to set (a null section cannot be filled from the command line). Set the section in a YAML "
              f"config, e.g. your experiment file{example}:\n  {top}:\n    {inner}: {{{leaf}: "
              f"{override.get_value_element_as_str()}}}", file=sys.stderr)
        sys.exit(2)


def _override_being_applied(err: Exception):
    """The Hydra override whose merge raised `err`, if it was raised while Hydra applied overrides."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_apply_overrides_to_config":
            return tb.tb_frame.f_locals.get("override")
        tb = tb.tb_next
    return None


def _raise(err: Exception):
    raise err


if __name__ == "__main__":
    with null_section_errors(sys.argv[1:]):
        main()
