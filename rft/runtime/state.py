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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rft.runtime.checkpoint import (Resume, finish_shards, record_layout, save_rank_state, save_shards, saved_layout,
                                    start_shards)
from rft.runtime.shard_writer import ShardWriter
from rft.runtime.topology import Topology

if TYPE_CHECKING:
    from rft.runtime.background_save import BackgroundSave

SHARDED = "__sharded__"  # a rank file's record of its sharded components and the files it wrote for them


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
    """The tracked components of one rank; `save` writes them all, a resumed run restores them.

    A component with `checkpoint_shards(prefix)` (the trainer's model, reference and optimizer:
    rft/trainer/sharded_state.py) is saved by every trainer rank together, layout-free, instead of
    into the rank's file, and loads into whatever layout this run has (a collective: the trainer
    ranks track their components in the same order)."""

    def __init__(self, run_dir: str, topology: Topology, resume: Resume | None):
        self.run_dir, self.topology, self.resume = run_dir, topology, resume
        self.rank = topology.rank
        source = resume.source_rank(topology.rank, topology.role, topology.role_rank, topology.trainer_ranks) \
            if resume else None
        self.saved: dict[str, Any] | None = resume.load(source) if resume else None
        self.resume_done = resume.done if resume else None
        self.components: dict[str, Stateful] = {}
        self.shards_checked = False  # the sharded files' checksums, checked before the first load
        self.background: BackgroundSave | None = None  # a checkpoint being written (trainer.async_save)
        self.writer: ShardWriter | None = None  # the process writing it, started at the first such save

    @property
    def resuming(self) -> bool:
        return self.saved is not None

    def track(self, name: str, component: S, restore: bool = True) -> S:
        """Save `component` with every checkpoint from now on (replacing one of the same name);
        load its saved state now if this run resumes and `restore` (stage components: only in
        the stage the checkpoint was taken in)."""
        self.components[name] = component
        if not restore or self.saved is None:
            return component
        if name in self.saved.get(SHARDED, {}).get("components", ()):
            component.load_state_dict(self._load_shards(name, component))
        elif self.saved.get(name) is not None:
            component.load_state_dict(self.saved[name])
        return component

    def _load_shards(self, name: str, component: Stateful) -> dict[str, Any]:
        """A sharded component's state in this rank's layout. Before the first, trainer rank i
        checks the files of the saving trainer ranks i, i + T, i + 2T, ... (T: this run's trainer
        ranks) against their sha256, so that together they check every file, whatever the two layouts."""
        template = component.checkpoint_shards(f"{name}.", loading=True)
        if template is None:
            raise ValueError(f"the checkpoint holds {name} sharded, and this run cannot load it so")
        files = []
        if not self.shards_checked:
            saved_trainers = (saved_layout(self.resume.step_dir) or {}).get("trainer_ranks", self.topology.trainer_ranks)
            owners = range(self.topology.role_rank, saved_trainers, self.topology.trainer_ranks)
            files = [(self.saved if owner == self.rank else self.resume.load(owner))[SHARDED]["files"]
                     for owner in owners]
            self.shards_checked = True
        return self.resume.load_shards({name: template}, files)[name]

    def untrack(self, *names: str) -> None:
        """Stop saving these components (a stage's, when it ends)."""
        for name in names:
            self.components.pop(name, None)

    def resumed(self) -> None:
        """The checkpoint's stage has been entered: later stages start fresh."""
        self.saved = None

    def save(self, done: int, background: bool = False) -> str | None:
        """Write every tracked component for checkpoint `step<done>`: this rank's file, and the
        sharded ones with the other trainer ranks'. `background` (trainer.async_save): the sharded
        ones are written while the rank goes on, and this rank's file once `finish_background`
        completes them (rft/runtime/background_save.py); returns the rank file's path, or None then."""
        self.finish_background()  # an earlier write still going: the checkpoints complete in order
        shards = {name: c.checkpoint_shards(f"{name}.") for name, c in self.components.items()
                  if hasattr(c, "checkpoint_shards")}
        shards = {name: s for name, s in shards.items() if s is not None}
        state = {name: c.state_dict() for name, c in self.components.items() if name not in shards}
        if self.rank == 0:
            t = self.topology
            record_layout(self.run_dir, done, {"trainer_ranks": t.trainer_ranks, "voting_ranks": t.voting_ranks})
        if shards and background:
            self.background = start_shards(self.run_dir, done, shards, state, self.start_writer())
            return None
        if shards:
            state[SHARDED] = {"components": sorted(shards), "files": save_shards(self.run_dir, done, shards)}
        return save_rank_state(self.run_dir, done, self.rank, state)

    def start_writer(self) -> ShardWriter:
        """The process that writes this rank's background saves (trainer.async_save); started
        again if it died between two writes (killed by hand or for memory)."""
        if self.writer is None or not self.writer.alive:
            self.writer = ShardWriter()
        return self.writer

    @property
    def writing(self) -> bool:
        """A background save of this rank is still writing its shards."""
        return self.background is not None and self.background.writing

    def finish_background(self) -> int | None:
        """Every trainer rank together: complete the background save, if any, waiting for its write;
        the step of the checkpoint it completed."""
        if self.background is None:
            return None
        pending, self.background = self.background, None
        state = {**pending.state, SHARDED: {"components": pending.components, "files": finish_shards(pending)}}
        save_rank_state(self.run_dir, pending.done, self.rank, state)
        return pending.done


class Value:
    """A plain value as a component (e.g. the weights version an engine serves)."""

    def __init__(self, value: Any = None):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
