"""A run's curves, read from its `metrics/<rank>.jsonl` files (the source of truth every tracker is
fed from): per stage, per scalar, the steps and values; what a plot draws."""

from __future__ import annotations

import glob
import os
from collections import defaultdict
from dataclasses import dataclass, field

import yaml

from rft.config.flatten import flatten
from rft.runtime.storage import read_jsonl


@dataclass
class Curve:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RunCurves:
    """One run directory's scalars: `curves[stage][key]`, stages in the order they ran."""

    run_dir: str
    stages: list[str]
    curves: dict[str, dict[str, Curve]]

    def stage(self, name: str) -> dict[str, Curve]:
        return self.curves.get(name, {})

    def whole_run(self, key: str) -> Curve:
        """`key` over every stage, on the run's global step axis."""
        out = Curve()
        for name in self.stages:
            curve = self.curves[name].get(key)
            if curve is not None:
                out.steps += curve.steps
                out.values += curve.values
        return out


def is_run_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "metrics"))


def run_dirs_in(path: str) -> list[str]:
    """A run directory itself, or a sweep directory's runs (`<sweep dir>/<n>`, in order of n)."""
    if is_run_dir(path):
        return [path]
    runs = [d for d in glob.glob(os.path.join(path, "*")) if is_run_dir(d)]
    return sorted(runs, key=lambda d: (not os.path.basename(d).isdigit(), int(os.path.basename(d))
                                       if os.path.basename(d).isdigit() else 0, d))


def read_run(run_dir: str) -> RunCurves:
    """Every rank's scalars of the run; a scalar several ranks log at one step (each engine's
    `rollout/*`, both roles' `data/*`) is their mean."""
    sums: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    stages: list[str] = []
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics", "*.jsonl"))):
        if os.path.basename(path) == "eval.jsonl":  # the same evals are scalars of the explorer's file
            continue
        for row in read_jsonl(path):
            stage, step = row.get("stage", "main"), row.get("step", 0)
            if stage not in stages:
                stages.append(stage)
            for key, value in row.items():
                if key not in ("stage", "step", "time") and isinstance(value, (int, float)):
                    sums[stage][key][step].append(float(value))
    order = [name for name in stage_order(run_dir) if name in stages] + [s for s in stages if s not in stage_order(run_dir)]
    curves = {stage: {key: Curve(sorted(by_step), [sum(v) / len(v) for _, v in sorted(by_step.items())])
                      for key, by_step in sums[stage].items()} for stage in order}
    return RunCurves(run_dir, order, curves)


def stage_order(run_dir: str) -> list[str]:
    """The stage names in the order the run's config lists them."""
    config = run_config(run_dir)
    return [s["name"] for s in config.get("stages") or []] or ["main"]


def run_config(run_dir: str) -> dict:
    """The run's resolved config (`config.yaml`, written at launch); {} if absent."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return yaml.safe_load(f) or {}


def flat_config(run_dir: str) -> dict[str, str]:
    """`section.key` -> value text of the run's config, stages flattened as `stages.<name>.<key>`."""
    return flatten(run_config(run_dir))
