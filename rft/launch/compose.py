"""From the command line's config to a run ready to submit: compose (Hydra) -> typed config with
the cluster kind and GPUs resolved -> validate -> own the run directory, resume or start over ->
create the generated inputs (tiny model, synthetic tasksets)."""

from __future__ import annotations

import os
import sys

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rft.config import RFTConfig
from rft.config.checks import validate
from rft.config.plugin_checks import absolute_plugin_files
from rft.runtime.decoupled import JOB_DIRS, split_run_dir
from rft.runtime.run_dir import Owner


def prepare(cfg: RFTConfig) -> None:
    """Create what the config says to generate: the tiny model and synthetic tasksets (of the top
    level, and of every stage that sets its own generator: rft.config.generated_data)."""
    from rft.config import generated_data
    from rft.data.arithmetic import write_arithmetic_tasksets
    from rft.explorer.envs import write_env_tasksets

    os.makedirs(cfg.run.output_dir, exist_ok=True)
    for section in generated_data(cfg):
        data = section.data
        if data.from_env is not None:
            write_env_tasksets(section.rollout.env, data.from_env, data.train_path, data.eval_path, cfg.seed)
        elif data.shapes is not None:
            from rft.data.shapes import write_shapes_tasksets

            write_shapes_tasksets(data.shapes, data.train_path, data.eval_path, cfg.seed)
        else:
            write_arithmetic_tasksets(data.arithmetic, data.train_path, data.eval_path, cfg.seed)
    if cfg.model.tiny is not None:
        from rft.models.tiny import create_tiny_model

        create_tiny_model(cfg.model.tiny, cfg.model.path, cfg.seed)


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
        if dcfg.sync.get("decoupled") and dcfg.get("mode") in JOB_DIRS:  # one half of a run: its own files
            split_run_dir(dcfg)
        cfg: RFTConfig = OmegaConf.to_object(dcfg)
    except MissingMandatoryValue as err:
        raise ValueError(_missing_key_message(err)) from None
    except OmegaConfBaseException as err:  # a bad interpolation, a value of the wrong type
        key = getattr(err, "full_key", None)
        raise ValueError(f"{key + ': ' if key else ''}{str(err).splitlines()[0]}") from None
    cfg.run.output_dir = os.path.abspath(cfg.run.output_dir)
    absolute_plugin_files(cfg)  # "rewards.py:fn" is relative to here; a Slurm job's ranks start elsewhere
    if cfg.monitor.group is None:  # what groups the tracked runs (W&B, MLflow): the sweep, else the run
        sweep_dir = HydraConfig.get().sweep.dir if multirun else None
        parent, leaf = os.path.split(os.path.normpath(os.path.abspath(sweep_dir or cfg.run.output_dir)))
        cfg.monitor.group = f"{os.path.basename(parent)}/{leaf}"  # e.g. quickstart/2026-11-28_10-00-00
    from rft.launch.slurm import check_against_cluster, check_request, resolve_cpus, resolve_gpus, resolve_kind

    if cfg.cluster.kind == "auto":
        cfg.cluster.kind, why = resolve_kind(cfg.cluster)
        print(f"rft: cluster=auto -> {cfg.cluster.kind} ({why})")
    if cfg.cluster.kind == "slurm" and cfg.cluster.allocation:
        cfg.cluster.wait = True  # a step ends with the srun the launcher starts: it is followed to its end
    for note in (resolve_gpus(cfg), resolve_cpus(cfg) if cfg.cluster.kind == "slurm" else None):
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
    from rft.launch.attempts import start_or_resume
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
