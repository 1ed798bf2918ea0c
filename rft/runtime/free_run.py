"""Free-running exploration (sync.free_run): the explorer never meets the trainer at its steps.

In lockstep (rft/runtime/schedule.py) every voting rank meets at every trainer step, so the
explorer, however far ahead `sync.offset` lets it start, stops at each meeting until the trainer
gets there. Free-running, only the trainer ranks meet at their steps, and they talk to the
explorer through three keys of the control store (hosted by rank 0):

    trainer rank 0, before each weight sync:   OFFER <- (version, weights)   the engines may take it
    trainer rank 0, after a checkpoint's files: SAVE  <- (done, stopping)    the explorer adds its own
    an explorer on Slurm's stop signal:        STOP  <- 1                   the trainers vote to stop

and the explorer's loop becomes

    for each step e:
        take the newest OFFER; wait only while shard e would be too stale when trained
        generate shard e, write it
        answer SAVE: write this rank's file into that checkpoint (stopping: then requeue with all)
    wait for the stage's last OFFER, answering SAVE meanwhile; evaluate

Why the staleness bound needs no meeting: shard e is trained at trainer step e + 1 (0-based
shards, 1-based steps), so with weights `v` its lag there is e - v trainer steps. The explorer
starts shard e only once e - v <= buffer.max_staleness: it runs ahead while it may, and its
experience is never dropped as stale.

Why a checkpoint stays exact: the explorer saves its state at a step boundary e >= done (the
trainer at step `done` has trained shard done - 1, which the explorer wrote), into the same
`checkpoints/step<done>/` (complete once its file is there, rft/runtime/checkpoint.py). A resumed
run sets aside the shards written after e and gives back to the trainer the ones it took after
`done` (rft/runtime/task.py), as with sync.offset, so every task's samples are trained exactly once.

Weights: with the broadcast engines (gloo, nccl) the trainer's send waits until every engine
joins, at its next step boundary; the checkpoint engine's writes wait for no one, and the
engines load the newest version offered. `weights` is the newest version whose tensors travelled:
a step without an optimizer step offers a new version name for the same weights.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from rft.runtime.membership import Meeting, MemberLostError, lost_ranks

OFFER, SAVE, STOP = "rft-free/offer", "rft-free/save", "rft-free/stop"
POLL_S = 0.05


@dataclass(frozen=True, order=True)
class Offer:
    version: int  # what the engines' weights are called once taken: trainer steps done
    weights: int  # the newest version whose tensors were sent (== version unless none changed since)


@dataclass(frozen=True, order=True)
class SaveRequest:
    done: int  # the checkpoint's name: trainer steps done
    stopping: bool  # Slurm asked the job to stop: after saving, every rank requeues together


def _read(store: dist.Store, key: str):
    return pickle.loads(store.get(key)) if store.check([key]) else None


class TrainerVotes:
    """The trainer ranks' meeting at each of their steps in a free-running stage: the control
    group's `vote` and `any` (rft/runtime/preemption.py) without the explorer, plus its stop flag."""

    def __init__(self, store: dist.Store, trainer_ranks: int, me: int, timeout_s: float,
                 name_of: Callable[[int], str]):
        self.store = store
        self.meeting = Meeting(store, list(range(trainer_ranks)), me, timeout_s, name_of, host=0)
        self.rounds = 0
        self.weights = 0  # the newest version whose tensors were sent (a stage's first sync always sends)

    def vote(self, stop_requested: bool, *flags: bool) -> list[bool]:
        """As ControlGroup.vote; the first flag (stop?) is also True once an explorer asked."""
        self.rounds += 1
        mine = [bool(stop_requested) or self.store.check([STOP]), *(bool(f) for f in flags)]
        posted = self.meeting.post(f"rft-free-votes/{self.rounds}", mine)
        return [any(votes[i] for votes in posted.values()) for i in range(len(mine))]

    def any(self, flag: bool) -> bool:
        self.rounds += 1
        posted = self.meeting.post(f"rft-free-votes/{self.rounds}", bool(flag))
        return any(posted.values())

    def offer(self, version: int, sends_weights: bool) -> None:
        """Trainer rank 0, before the sync of `version`: the engines may take it (`sends_weights`:
        its tensors travel; else the engines hold them already and only take the new name)."""
        if sends_weights:
            self.weights = version
        self.store.set(OFFER, pickle.dumps(Offer(version, self.weights)))

    def request_save(self, done: int, stopping: bool) -> None:
        """Trainer rank 0, once the trainer ranks saved checkpoint `done`: the explorer's file completes it."""
        self.store.set(SAVE, pickle.dumps(SaveRequest(done, stopping)))


class ExplorerLink:
    """An explorer's side of the keys: what the trainer offered and asked for, and its stop flag.
    `waiting_for`: the trainer ranks, whose loss ends a wait with an error naming them."""

    def __init__(self, store: dist.Store, trainer_ranks: int, timeout_s: float, name_of: Callable[[int], str]):
        self.store, self.timeout_s, self.name_of = store, timeout_s, name_of
        self.trainers = list(range(trainer_ranks))
        self.stop_posted = False

    def offer(self) -> Offer | None:
        return _read(self.store, OFFER)

    def save_request(self) -> SaveRequest | None:
        return _read(self.store, SAVE)

    def post_stop(self) -> None:
        """Slurm's stop signal reached this explorer: the trainers stop at their next step."""
        if not self.stop_posted:
            self.store.set(STOP, b"1")
            self.stop_posted = True

    def wait(self, ready: Callable[[], bool], what: str, chore: Callable[[], object] = lambda: None) -> None:
        """Until `ready()`; `chore()` between looks (answer a checkpoint). Fails naming the trainer
        if it is lost, or after sync.timeout_s without progress."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            chore()
            gone = lost_ranks(self.store, self.trainers)
            if gone:
                rank, how = next(iter(gone.items()))
                raise MemberLostError(f"{self.name_of(rank)} failed: {how}; see its log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the explorer waited {self.timeout_s:.0f}s (sync.timeout_s) for {what} from "
                                   f"{self.name_of(0)}: stalled, or on a node that is gone? see its log")
            time.sleep(POLL_S)

    def newer_than(self, offer: Offer | None, save: SaveRequest | None) -> bool:
        """Whether the trainer offered or asked for anything since (`offer`, `save`)."""
        now_offer, now_save = self.offer(), self.save_request()
        return ((now_offer is not None and (offer is None or now_offer.version > offer.version))
                or (now_save is not None and (save is None or now_save.done > save.done)))
