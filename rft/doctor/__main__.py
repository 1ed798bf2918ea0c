"""`python -m rft.doctor +experiment=NAME [overrides]`: check this node before a run, with the run's
config: library versions, the GPUs each rank would take, a collective between two processes, vLLM
generating, sleeping and waking at both levels and loading weights with the same tokens, the
optimizer's state saved and loaded, the run directory writable. One table, pass / fail / skip and
what to do; exit 1 if anything failed. Through Slurm, run it as the job's command on a compute node
(`srun python -m rft.doctor ...`) to check that node.

Checks that need a GPU take the CPU path here and say so (gloo for NCCL, torch's AdamW for
Transformer Engine's FusedAdam): on a laptop or in CI the same code runs."""

from __future__ import annotations

import os
import sys
import tempfile


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rft.config import register_configs

    register_configs()
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
    if not any(o.lstrip("+").startswith("run.output_dir=") for o in overrides):
        overrides = [*overrides, f"run.output_dir={tempfile.mkdtemp(prefix='rft-doctor-')}"]
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        dcfg = compose(config_name="config", overrides=overrides)
    if OmegaConf.is_missing(dcfg.model, "path"):
        dcfg.model.path = ""  # no model named: the engine check uses the quickstart's tiny model
    if OmegaConf.is_missing(dcfg.data, "train_path"):
        dcfg.data.train_path = ""
    return OmegaConf.to_object(dcfg)


def main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from rft.doctor import checks

    console = Console()
    try:
        cfg = _config(argv)
    except Exception as err:  # Hydra's or OmegaConf's: name it, no traceback
        console.print(f"rft doctor: config error: {err}")
        return 2
    results = [checks.versions(), checks.devices(cfg)]
    with console.status("an all-reduce between two processes..."):
        results.append(checks.collective())
    with console.status("vLLM: generate, sleep, wake, load weights..."):
        results += checks.engine(cfg)
    results += [checks.optimizer_state(), checks.run_dir(cfg)]
    table = Table(title="rft doctor: this node", show_lines=True)
    for column in ("check", "result", "seen", "what to do"):
        table.add_column(column, overflow="fold")
    colour = {"pass": "green", "fail": "red", "skip": "yellow"}
    for result in results:
        table.add_row(result.name, f"[{colour[result.status]}]{result.status}", result.seen, result.fix)
    console.print(table)
    failed = [r.name for r in results if r.status == "fail"]
    console.print(f"failed: {', '.join(failed)}" if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
