"""Pictures of runs, drawn with matplotlib from `metrics/*.jsonl`.

- `draw_run(run_dir)`: `plots/<stage>.png` and `.svg` per stage: reward (or the SFT loss),
  held-out accuracy, response length, entropy, KL, clip fraction and step time over steps. The
  launcher draws a stage's when it ends and all of them after the run (rft/launch/submit.py).
- `python -m rft.plot RUN_DIR [RUN_DIR ...]` (or a sweep directory): several runs on shared axes,
  one colour per run, the config keys that differ between them in the legend.
"""

from __future__ import annotations

import os

from rft.plot.figures import compare_figure, stage_figure
from rft.plot.series import read_run, run_dirs_in

__all__ = ["compare_runs", "draw_run", "draw_stage", "run_dirs_in"]


def draw_stage(run_dir: str, stage: str) -> list[str]:
    """`plots/<stage>.png` and `.svg` of one stage; the paths written."""
    return stage_figure(read_run(run_dir), stage, os.path.join(run_dir, "plots", f"{stage}.png"))


def draw_run(run_dir: str) -> list[str]:
    """Every stage's plots; the paths written."""
    run = read_run(run_dir)
    return [p for stage in run.stages for p in stage_figure(run, stage, os.path.join(run_dir, "plots", f"{stage}.png"))]


def compare_runs(run_dirs: list[str], path: str) -> list[str]:
    """Several runs on shared axes into `path` (.png and .svg)."""
    return compare_figure([read_run(d) for d in run_dirs], path)
