"""A rollout rank's free-running stage (sync.free_run; the protocol is rft/runtime/free_run.py):

    for each step:
        generate and write the step's shard            (unless resumed: done before the checkpoint)
        between steps, until the next shard may start:
            agree with the other engines on what the trainer offered and asked for
            answer a checkpoint asked for: this rank's file, at this step; stopping: requeue with all
            take the newest weights offered
            wait for newer ones while the next shard would be trained more than
            buffer.max_staleness trainer steps after its weights
    after the last step: the same, until the stage's last weights are taken

With rollout.partial_rollout a thread of the rank takes each offer as it comes instead, cutting
the generations in flight, which go on with the new weights (RolloutEngine.generate); the step
boundaries then only answer checkpoints and wait for the version the next shard needs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from rft.config import RFTConfig
from rft.runtime.control import Runtime, Stage, Step
from rft.runtime.free_run import POLL_S, ExplorerLink, Offer, SaveRequest
from rft.runtime.preemption import requeue_or_stop
from rft.runtime.schedule import is_eval_step
from rft.runtime.topology import Topology


@dataclass(frozen=True)
class Seen:
    """What every engine agrees the trainer offered and asked for, at one look, and the version
    they all serve (the oldest any engine serves; None while one serves a restart's weights)."""

    offer: Offer | None
    save: SaveRequest | None
    served: int | None


class FreeRunning:
    def __init__(self, cfg: RFTConfig, topology: Topology, runtime: Runtime, explorer):
        self.cfg, self.runtime, self.explorer = cfg, runtime, explorer
        self.link = ExplorerLink(runtime.group.store, topology.trainer_ranks, cfg.sync.timeout_s, topology.member_name)
        self.lead = cfg.buffer.max_staleness
        self.answered = 0  # the newest checkpoint this rank wrote its file into
        self.loaded: int | None = None  # the weights version the engines hold (None: a restart's, not the trainer's)
        self.looks = 0  # agreements so far: every engine looks alike, so their meeting keys match
        self.watcher: WeightWatcher | None = None  # rollout.partial_rollout: takes offers mid-generation

    def run_stage(self, stage: Stage) -> None:
        explorer = self.explorer
        # a restarted explorer's engines hold the model's initial weights, whatever version it saved
        self.loaded = None if stage.resumed else explorer.version.value
        if stage.cfg.rollout.partial_rollout:
            self.watcher = WeightWatcher(self.link, self.take)
        try:
            self._steps(stage)
        finally:
            if self.watcher is not None:
                self.watcher.stop()
                self.watcher = None

    def _steps(self, stage: Stage) -> None:
        explorer, steps = self.explorer, stage.cfg.trainer.max_steps
        for step in stage.steps():
            scalars = step.pending if step.resumed else explorer.explore(stage, step)
            self.runtime.log(stage, step.global_step, scalars)
            if is_eval_step(self.cfg, step.global_step, step.index, steps):
                explorer.evaluate(stage, "interval", step.global_step)
            # the next shard (step.global_step, 0-based) is trained at trainer step step.global_step + 1;
            # after the last one the stage's last weights are wanted (its end evaluation uses them)
            last = step.index + 1 == steps
            self.between(stage, step, step.global_step if last else step.global_step - self.lead)

    def between(self, stage: Stage, step: Step, need: int) -> None:
        """After `step`: answer checkpoints, take the newest weights, until version `need` is served."""
        with self.runtime.timed("sync_wait_s"):
            while True:
                seen = self.agree(step)
                self.answer(seen.save, stage, step)
                if self.watcher is None:  # else the watcher takes the offers as they come
                    self.take(seen.offer)
                    seen = Seen(seen.offer, seen.save, self.served())  # every engine took the same
                if seen.served is not None and seen.served >= need:
                    return
                self.link.wait(lambda seen=seen: self.link.newer_than(seen.offer, seen.save) or
                               (self.served() or -1) >= need, f"weights version {need}", chore=self.post_stop)

    def served(self) -> int | None:
        """The version this rank's engines serve (None: a restart's weights, not the trainer's yet)."""
        if self.watcher is not None:
            self.watcher.raise_failure()
        return None if self.loaded is None else self.explorer.version.value

    def agree(self, step: Step) -> Seen:
        """The trainer's offer and checkpoint request, the newest any engine saw, and the version all
        serve: every engine takes the same weights (a broadcast needs every one), saves at the same
        step, and goes on to the next step alike."""
        self.post_stop()
        self.looks += 1
        mine = Seen(self.link.offer(), self.link.save_request(), self.served())
        shares = self.explorer.dealer.gather(f"free/{step.global_step}/{self.looks}", mine).values()
        offers = [s.offer for s in shares if s.offer is not None]
        saves = [s.save for s in shares if s.save is not None]
        served = [s.served for s in shares]
        return Seen(max(offers, default=None), max(saves, default=None),
                    None if None in served else min(served))

    def post_stop(self) -> None:
        if self.runtime.stop.requested:
            self.link.post_stop()

    def answer(self, save: SaveRequest | None, stage: Stage, step: Step) -> None:
        """This rank's file of the newest checkpoint the trainer saved, at this step; on a stop,
        requeue with every rank (rft/runtime/preemption.py)."""
        if save is None or save.done <= self.answered:
            return
        self.runtime.save_own(save.done, stage, step)
        self.answered = save.done
        if save.stopping:
            if self.runtime.monitor is not None:
                self.runtime.monitor.close()
            requeue_or_stop(self.runtime.group, self.runtime.stop, self.cfg.run.output_dir, save.done, self.cfg.cluster)

    def take(self, offer: Offer | None) -> None:
        """Load the offered weights unless the engines hold them; serve them as the offered version."""
        if offer is None or (self.loaded is not None and offer.version <= self.explorer.version.value):
            return
        if offer.weights != self.loaded:
            self.explorer.receive_weights(offer.weights)
            self.loaded = offer.weights
        self.explorer.keep_weights(offer.version)


class WeightWatcher:
    """rollout.partial_rollout: a thread that takes each offer as soon as the trainer makes it,
    cutting the generations in flight (they go on with the new weights); its failure (a sync that
    timed out) is raised on the rank's own thread at its next look (`raise_failure`)."""

    def __init__(self, link: ExplorerLink, take):
        self.link, self.take = link, take
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._watch, name="rft-weight-watcher", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        seen = None
        try:
            while not self.stopped.wait(POLL_S):
                offer = self.link.offer()
                if offer is not None and offer != seen:
                    self.take(offer)
                    seen = offer
        except BaseException as err:  # noqa: BLE001 - handed to the rank's thread
            self.failure = err

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.raise_failure()
