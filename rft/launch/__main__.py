"""`python -m rft.launch +experiment=NAME [overrides]`: compose, validate, plan, submit, watch.

    compose (Hydra) -> validate -> own the run directory, resume or start over
    -> create generated inputs (tiny model, synthetic data) -> print the plan
    -> submit one job of T+R tasks (submitit) -> progress bar -> summary

The steps live in this package: compose.py (config, run directory, generated inputs), plan.py,
submit.py (executor, job array, following the job), report.py and failures.py (progress, summary,
the failing rank), sweep.py (`-m`), slurm.py (the launcher's side of Slurm).
"""

from __future__ import annotations

import contextlib
import os
import sys

import hydra
from omegaconf import DictConfig

from rft.config import register_configs
from rft.launch.compose import configure, take_run_dir
from rft.launch.submit import submit

register_configs()


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from rft.launch import sweep
    from rft.runtime.run_dir import release

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        cfg = configure(dcfg, multirun)
        if multirun and sweep.leave_finished(cfg, HydraConfig.get().job.num):
            return  # a sweep launched again: its finished runs stay as they are
        owner, attempt = take_run_dir(cfg)
    except ValueError as err:  # RunDirBusy included
        print(f"rft: config error: {err}", file=sys.stderr)
        sys.exit(2)  # in a sweep: before anything was submitted to Slurm
    if multirun and (cfg.cluster.kind == "slurm" or attempt):  # which run goes where, resumed or not
        print(f"rft: sweep run {HydraConfig.get().job.num} -> {cfg.run.output_dir}" + (f": {attempt}" if attempt else ""))
    if multirun and cfg.cluster.kind == "slurm" and not cfg.cluster.allocation:  # in an allocation: step by step
        sweep.QUEUED.append((cfg, owner, attempt))  # submitted as one array when the sweep ends (rft/launch/sweep.py)
        return
    try:
        code = submit(cfg, owner, attempt)
    finally:
        if cfg.cluster.kind == "local" or cfg.cluster.wait:
            release(cfg.run.output_dir, owner)  # else the Slurm job owns it while it is queued or runs
    if not multirun:
        sys.exit(code)
    sweep.EXIT_CODES.append(code)


# Sections that are null unless a config sets them (Optional[...] in the schema, rft/config/), and a config
# that sets each
UNSET_SECTIONS = {"model.tiny": "conf/model/tiny_qwen2.yaml", "data.arithmetic": "conf/experiment/quickstart.yaml",
                  "data.shapes": "conf/experiment/quickstart_vl.yaml",
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
