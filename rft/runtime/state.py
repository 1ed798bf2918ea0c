"""What a rank saves at a checkpoint: components that save and load themselves.

A rank `track`s each component that must survive a restart (its position in the run, the model,
the optimizer, a taskset cursor, the engine's weights version, ...). One `save(done)` writes all
of them into the rank's file of checkpoint `step<done>` (rft/runtime/checkpoint.py); on a resumed run,
`track` hands each component its saved state as it is created. Components that live for one stage
(an optimizer, a cursor) are restored only in the stage the checkpoint was taken in (torchtitan's
`Stateful` + one checkpoint point, instead of untyped dicts read back by string key).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TypeVar

from rft.runtime.checkpoint import Resume, save_rank_state


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


S = TypeVar("S", bound=Stateful)


@dataclass
class Progress:
    """Where a rank is in the run and what it has counted so far.

    A checkpoint is taken at a trainer step's control point, before that step's weight sync
    (rft/runtime/control.py), so a resumed rank re-enters stage `stage_index` at `step` with the
    step's work done: `pending` holds the scalars it had not logged yet, `voted` the trainer step
    whose vote the checkpoint came from (the explorer meets several in a stage's last step).
    """

    global_step: int = 0  # steps done over all stages (explorer: steps generated)
    stage_index: int = 0
    step: int = 0  # the stage step the checkpoint was taken in
    voted: int = 0  # the trainer step (of that stage) whose control point took the checkpoint
    pending: dict[str, float] = field(default_factory=dict)  # that step's scalars, logged after its sync
    totals: dict[str, float] = field(default_factory=dict)  # seconds and counts over the run
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # per taskset file: rows skipped, truncated
    wall_s: float = 0.0  # wall time of earlier attempts
    started: float = field(default_factory=time.time, repr=False)  # this attempt's start (not saved)

    @property
    def elapsed_s(self) -> float:
        """Wall time of the run so far, earlier attempts included."""
        return self.wall_s + time.time() - self.started

    def add(self, **amounts: float) -> None:
        """Add seconds or counts to the run's totals."""
        for key, value in amounts.items():
            self.totals[key] = self.totals.get(key, 0) + value

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["wall_s"] = self.elapsed_s
        del state["started"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class RankState:
    """The tracked components of one rank; `save` writes them all, a resumed run restores them."""

    def __init__(self, run_dir: str, rank: int, resume: Resume | None):
        self.run_dir, self.rank = run_dir, rank
        self.saved: dict[str, Any] | None = resume.load(rank) if resume else None
        self.resume_done = resume.done if resume else None
        self.components: dict[str, Stateful] = {}

    @property
    def resuming(self) -> bool:
        return self.saved is not None

    def track(self, name: str, component: S, restore: bool = True) -> S:
        """Save `component` with every checkpoint from now on (replacing one of the same name);
        load its saved state now if this run resumes and `restore` (stage components: only in
        the stage the checkpoint was taken in)."""
        self.components[name] = component
        if restore and self.saved is not None and self.saved.get(name) is not None:
            component.load_state_dict(self.saved[name])
        return component

    def untrack(self, *names: str) -> None:
        """Stop saving these components (a stage's, when it ends)."""
        for name in names:
            self.components.pop(name, None)

    def resumed(self) -> None:
        """The checkpoint's stage has been entered: later stages start fresh."""
        self.saved = None

    def save(self, done: int) -> str:
        """Write every tracked component for checkpoint `step<done>` (this rank's file)."""
        return save_rank_state(self.run_dir, done, self.rank, {name: c.state_dict() for name, c in self.components.items()})


class Value:
    """A plain value as a component (e.g. the weights version an engine serves)."""

    def __init__(self, value: Any = None):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
