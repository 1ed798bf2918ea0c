"""Where a rank's scalars go besides `metrics/<rank>.jsonl` (`monitor.loggers`): TensorBoard, W&B,
MLflow, or a user's class given by dotted path, all behind one small interface.

A tracker is a class built as `cls(cfg, run)` (`run`: the `TrackedRun` below) with three methods:

    log(step, scalars)   one step's scalars (a dict of floats), steps never decreasing
    flush()              what was logged so far is durable: called before each checkpoint, so a
                         rank killed after it loses nothing the resumed run does not log again
    close()              at the rank's end

Each rank that logs (trainer rank 0, each engine's leader, as for TensorBoard) is its own tracked
run, named `<group>/<rank>`: their scalar names overlap (`data/*`, and every engine logs
`rollout/*`), so one tracked run per rank keeps every curve whole; `monitor.group` (the run, or the
sweep) gathers them. A resumed rank continues the same tracked run: the ids are kept in
`metrics/<rank>.trackers.json`.

The JSONL stays the source of truth: a tracker that fails (server down, quota, a missing package)
is reported once on the rank's stderr and left out from then on; the run goes on. Built-ins import
their client library only when selected.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from rft.registry import Registry
from rft.runtime.storage import write_text_atomic

TRACKERS = Registry("experiment tracker", params=("log", "flush", "close"), is_class=True)


@dataclass
class TrackedRun:
    """Who logs: what a tracker needs to name, group and resume its run."""

    run_dir: str
    rank_name: str  # trainer0, rollout1, ...: the TensorBoard run of the same rank
    group: str  # monitor.group: the run (or sweep) the rank belongs to
    resume_step: int | None  # a resumed rank's checkpoint step: it logs the steps from there again

    @property
    def name(self) -> str:
        return f"{self.group}/{self.rank_name}"

    @property
    def ids_path(self) -> str:
        return os.path.join(self.run_dir, "metrics", f"{self.rank_name}.trackers.json")

    def saved_id(self, tracker: str) -> str | None:
        """The id this rank's `tracker` run got in an earlier attempt."""
        if not os.path.exists(self.ids_path):
            return None
        with open(self.ids_path) as f:
            return json.load(f).get(tracker)

    def logged_steps(self) -> list[tuple[int, dict[str, float]]]:
        """(step, scalars) of every row in the rank's metrics/<rank>.jsonl: what a resumed tracker
        sends again where its own store lost it (the jsonl's steps from the checkpoint on are already
        dropped)."""
        from rft.runtime.storage import read_jsonl

        rows = read_jsonl(os.path.join(self.run_dir, "metrics", f"{self.rank_name}.jsonl"))
        return [(row["step"], {k: v for k, v in row.items() if k not in ("step", "stage", "time")}) for row in rows]

    def save_id(self, tracker: str, run_id: str) -> None:
        ids = {}
        if os.path.exists(self.ids_path):
            with open(self.ids_path) as f:
                ids = json.load(f)
        write_text_atomic(self.ids_path, json.dumps({**ids, tracker: run_id}), f"the {tracker} run id of {self.rank_name}")


def flat_params(cfg: Any) -> dict[str, str]:
    """The resolved config as `section.key` -> value text: what trackers log as parameters."""
    from omegaconf import OmegaConf

    from rft.config.flatten import flatten

    return flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


class Trackers:
    """The selected trackers of one rank, fed together; one that fails is reported once and dropped."""

    def __init__(self, cfg: Any, run: TrackedRun):
        import rft.runtime.trackers.builtins  # noqa: F401  (registers tensorboard, wandb, mlflow)

        self.active: dict[str, Any] = {}
        for name in cfg.monitor.loggers:
            try:
                self.active[name] = TRACKERS.resolve(name)(cfg, run)
            except Exception as err:  # a client library's own exceptions: connection, auth, quota
                self._report(name, "could not start", err)

    def call(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.active.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                del self.active[name]
                self._report(name, f"failed in {method}()", err)

    def get(self, name: str) -> Any:
        return self.active.get(name)

    @staticmethod
    def _report(name: str, what: str, err: Exception) -> None:
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        print(f"rft: warning: monitor.loggers: {name} {what} ({type(err).__name__}: {reason}); the run goes on "
              "without it, its scalars stay in metrics/*.jsonl", file=sys.stderr, flush=True)


PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # built-in tracker -> the package it needs


def check_trackers(cfg: Any) -> None:
    """At launch: every `monitor.loggers` entry names a built-in or a tracker class of the user's,
    its package is installed, and its options are valid."""
    import importlib.util

    import rft.runtime.trackers.builtins  # noqa: F401
    from rft.config import config_error

    for name in cfg.monitor.loggers:
        try:
            TRACKERS.resolve(name)
        except ValueError as err:
            config_error("monitor.loggers", list(cfg.monitor.loggers), str(err))
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            config_error("monitor.loggers", list(cfg.monitor.loggers),
                         f"{name} is not installed here: `pip install {PACKAGES[name]}` (or `pip install -e .[tracking]`)")
    if len(set(cfg.monitor.loggers)) != len(cfg.monitor.loggers):
        config_error("monitor.loggers", list(cfg.monitor.loggers), "names a tracker twice")
    if "wandb" in cfg.monitor.loggers and cfg.monitor.wandb.mode not in ("online", "offline"):
        config_error("monitor.wandb.mode", cfg.monitor.wandb.mode,
                     "use offline (files to `wandb sync` later) or online")
