"""A decoupled explorer's weights (sync.decoupled; the two jobs: rft/runtime/decoupled.py).

    before each step:  load the newest complete version the trainer job wrote, if newer
                       wait while the step's shard would be trained more than
                       buffer.max_staleness trainer steps after the weights served
    after the stage:   wait for the stage's last version (its end evaluation uses it)

Shard e is trained at the trainer job's step e + 1, after e steps: with weights `v` its lag there
is e - v, so the explorer starts it once v >= e - buffer.max_staleness, the free-running bound
(rft/runtime/free_run.py) with the weights directory in place of the control store. Every engine
of the job loads the same version at the same step: they agree on what they see first.
"""

from __future__ import annotations

import time

from rft.config import RFTConfig
from rft.explorer.serve import load_version
from rft.runtime.control import Stage, Step
from rft.runtime.decoupled import OTHER_JOB
from rft.weights.engines import newest_complete_version

POLL_S = 0.2


class WeightFollower:
    """The trainer job's weights for one explorer rank (`explorer`: its rft.explorer.explorer.Explorer,
    untyped here as that module builds this one)."""

    def __init__(self, cfg: RFTConfig, explorer):
        self.root, self.lead, self.timeout_s = cfg.sync.checkpoint_dir, cfg.buffer.max_staleness, cfg.buffer.wait_timeout_s
        self.explorer = explorer
        self.fresh = True  # this attempt's engines hold model.path's weights, whatever version its checkpoint names
        self.looks = 0  # agreements so far: every engine looks alike, so their meeting keys match

    def before(self, step: Step) -> dict[str, float]:
        """The newest weights, and the wait while they are too old for the step's shard."""
        shard = step.global_step - 1
        return self.follow(shard - self.lead, f"for shard {shard}")

    def at_end(self, stage: Stage) -> None:
        self.follow(stage.start + stage.cfg.trainer.max_steps, "for the stage's end evaluation")

    def follow(self, need: int, why: str) -> dict[str, float]:
        runtime, start = self.explorer.runtime, time.time()
        deadline = time.monotonic() + self.timeout_s
        with runtime.timed("sync_wait_s"):
            served, loaded = self.look()
            while served < need:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the explorer waited {self.timeout_s:.0f}s (buffer.wait_timeout_s) for weights "
                                       f"version {need} or newer in {self.root} {why} (it serves version {served}): "
                                       f"is {OTHER_JOB['explore']} on the same run.output_dir running? It may still "
                                       "wait for its allocation (squeue)")
                time.sleep(POLL_S)
                served, newly = self.look()
                loaded += newly
        return {"timing/weights_wait_s": time.time() - start - loaded, "timing/weight_apply_s": loaded,
                "sync/version": float(served)}

    def look(self) -> tuple[int, float]:
        """Load the newest complete version any engine sees, if newer than served; the version
        every engine serves (the oldest), and the seconds this rank spent loading."""
        explorer, dealer = self.explorer, self.explorer.dealer
        self.looks += 1
        newest = max(dealer.gather(f"follow/{self.looks}", newest_complete_version(self.root)).values())
        start = time.time()
        if newest > explorer.version.value or (self.fresh and newest > 0):
            if all(load_version(engine, self.root, newest) for engine in explorer.engines):
                explorer.version.value, self.fresh = newest, False
        elif self.fresh:  # nothing published yet: the engines' model.path weights are the trainer's first
            explorer.version.value, self.fresh = 0, False
        loaded = time.time() - start
        served = -1 if self.fresh else explorer.version.value  # -1: a restart's weights are no version yet
        return min(dealer.gather(f"follow/{self.looks}/served", served).values()), loaded
