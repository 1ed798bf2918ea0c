"""The launcher's side of tracking and pictures: before submit, MLflow's experiment exists (and a
new SQLite store its tables: created once here, not by every rank at once); as stages end and
after the run, `plots/<stage>.png` are drawn from the run's metrics (rft/plot/)."""

from __future__ import annotations

import os

from rft.config import RFTConfig
from rft.launch.console import console


def prepare_trackers(cfg: RFTConfig) -> None:
    """One warning line if the MLflow server does not answer: the ranks try again, and a rank that
    cannot reach it either goes on without it (rft/runtime/trackers/)."""
    if "mlflow" not in cfg.monitor.loggers:
        return
    from rft.runtime.trackers.mlflow_tracker import client, experiment_id, tracking_uri

    uri = tracking_uri(cfg)
    try:
        experiment_id(client(uri), cfg.monitor.mlflow.experiment or cfg.run.name)
    except Exception as err:  # MLflow's own exceptions, requests' connection errors
        reason = " ".join(str(err).split())[:200]
        console.print(f"[yellow]rft: warning: monitor.mlflow.tracking_uri={uri} does not answer ({reason}); the run "
                      "goes on, its ranks log to MLflow if they reach it, and every scalar stays in "
                      "metrics/*.jsonl and TensorBoard", soft_wrap=True, highlight=False)


def draw_plots(cfg: RFTConfig, stage: str | None = None) -> list[str]:
    """`plots/<stage>.png` and `.svg` of one stage, or of every stage; the paths. A plot that cannot
    be drawn is a warning, never the run's failure."""
    if not cfg.monitor.plots:
        return []
    from rft.plot import draw_run, draw_stage

    try:
        return draw_stage(cfg.run.output_dir, stage) if stage else draw_run(cfg.run.output_dir)
    except Exception as err:  # matplotlib's, or a metrics file cut by a crash
        console.print(f"[yellow]rft: warning: plots of {os.path.join(cfg.run.output_dir, 'plots')} not drawn "
                      f"({type(err).__name__}: {err}); `python -m rft.plot {cfg.run.output_dir}` draws them",
                      soft_wrap=True, highlight=False)
        return []
