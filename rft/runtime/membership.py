"""Meetings of the job's voting ranks through the control store, and ranks that are lost.

A meeting is a barrier that carries a payload: every member posts under the meeting's key and
waits until every other member has posted or is *lost*. A rank is lost once the task process that
supervised it (rft/runtime/task.py) marks it in the store after it died or failed (`rft-lost/<rank>`, with
how it ended). What a lost member means depends on the run:

    members the run may lose (`tolerated`: the engine leaders with rollout.on_engine_failure=continue)
        the meeting goes on without it; `Meeting.post` returns what the others posted
    any other member (the default: fail fast)
        the meeting raises at once, naming the rank, its role and how it ended

A member that never posts and is never marked (its node is gone) ends the meeting after the
timeout with an error naming it. Why the store and not a gloo all-reduce: a gloo group cannot go
on without a member, and a store meeting tells "dead" from "slow" by the mark instead of a timeout.

Every member that posted is seen by every reader (a member is marked only after it died, so it
cannot post once lost), so all readers agree on who was present.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

import torch.distributed as dist

LOST = "rft-lost"


class MemberLostError(RuntimeError):
    """A member the run cannot go on without failed or died."""


RESTARTS = "rft-engine-restarts"  # the job's engine restarts so far (rollout.on_engine_failure=restart)


def count_restart(store: dist.Store) -> None:
    """An engine restarted (rft/explorer/engine_restart.py): the next sync's weight groups take the
    new process in its place."""
    store.add(RESTARTS, 1)


def restarts_so_far(store: dist.Store) -> int:
    """The job's engine restarts so far. Read after a control meeting: every engine that restarted
    in the step counted itself before it voted, so every member reads the same number and names
    the next weight groups alike."""
    return int(store.add(RESTARTS, 0))


def mark_lost(store: dist.Store, rank: int, how: str) -> None:
    """Tell the job's meetings that `rank` is gone (`how`: the launcher's line on how it ended)."""
    store.set(f"{LOST}/{rank}", how)


def lost_ranks(store: dist.Store, ranks: list[int]) -> dict[int, str]:
    """Which of `ranks` are marked lost, and how each ended."""
    return {r: store.get(f"{LOST}/{r}").decode(errors="replace") for r in ranks if store.check([f"{LOST}/{r}"])}


class Meeting:
    """`members` (global ranks) meeting through `store`; `me` is this rank."""

    def __init__(self, store: dist.Store, members: list[int], me: int, timeout_s: float,
                 name_of: Callable[[int], str], tolerated: frozenset[int] = frozenset(), host: int | None = None):
        self.store, self.members, self.me, self.timeout_s = store, members, me, timeout_s
        self.name_of, self.tolerated = name_of, tolerated
        # the member whose process hosts the store (None: not a member): the store ends with it, so
        # it leaves a meeting last, once every other member has read, and frees the meeting's keys
        self.host = host
        self.present: list[int] = list(members)  # who posted at the last meeting (every member agrees)
        # what this member does while it waits for the others (about every 0.2 s): an explorer writes
        # again a shard the trainer, which it waits for, quarantined (rft/buffer/shards.py)
        self.while_waiting: Callable[[], object] | None = None

    def post(self, key: str, payload: object) -> dict[int, object]:
        """Post `payload` under `key` (a name every member uses alike); every present member's
        payload, by rank, once all have posted or are lost."""
        names = {r: f"{key}/{r}" for r in self.members}
        self.store.set(names[self.me], pickle.dumps(payload))
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        waiting = [r for r in self.members if r != self.me]
        next_chore = time.monotonic() + 0.2
        while True:
            # check() of a key that is there is one round trip; a timed-out store.wait() is avoided:
            # torch's TCPStore client may read its late reply as the answer to the next command
            waiting = [r for r in waiting if not self.store.check([names[r]])]
            if not waiting:
                break
            gone = lost_ranks(self.store, waiting)
            for rank, how in gone.items():
                if rank not in self.tolerated:
                    raise MemberLostError(f"{self.name_of(rank)} failed: {how}; see its log")
            waiting = [r for r in waiting if r not in gone]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name_of(self.me)}: {', '.join(self.name_of(r) for r in waiting)} did not "
                                   f"reach {key!r} within {self.timeout_s:.0f}s (sync.timeout_s): stalled, or on a "
                                   "node that is gone? see their logs")
            if self.while_waiting is not None and time.monotonic() >= next_chore:
                self.while_waiting()
                next_chore = time.monotonic() + 0.2
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        present = [r for r in self.members if self.store.check([names[r]])]
        payloads = {r: pickle.loads(self.store.get(names[r])) for r in present}
        read_key = f"{key}/read"
        readers = self.store.add(read_key, 1)
        # one member deletes the keys, so no add(read_key, 0) can bring a deleted counter back
        if self.me == self.host:
            self._wait_for_readers(read_key, present, deadline)
        if self.me == self.host or (self.host is None and readers == len(present)):
            for name in [names[r] for r in present] + [read_key]:
                self.store.delete_key(name)
        self.present = present
        return payloads

    def _wait_for_readers(self, read_key: str, present: list[int], deadline: float) -> None:
        """Until every present member has read (or is lost since): the host may end right after
        the meeting (the run's last one), and the store with it."""
        while time.monotonic() < deadline:
            unread = len(present) - self.store.add(read_key, 0)
            if unread <= len(lost_ranks(self.store, present)):
                return
            time.sleep(0.002)


class PulseWatch:
    """Rank 0, when the run may lose engines: marks lost each engine leader of `ranks` whose pulse
    stopped (rft/runtime/pulse.py) or that lost the network to rank 0, for SILENT_S seconds. A
    rank that fails or is killed is marked by its own supervising task (rft/runtime/task.py), but
    a node that crashed or dropped off the network takes that task with it: without this mark the
    others would wait for it until sync.timeout_s and then fail, though the run could go on.
    Its own client of the store: torch's TCPStore client is not shared between threads."""

    def __init__(self, store: dist.Store, run_dir: str, ranks: frozenset[int], name_of: Callable[[int], str]):
        import threading

        self.store, self.run_dir, self.ranks, self.name_of = store, run_dir, ranks, name_of
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="rft-pulse-watch", daemon=True).start()

    def stop(self) -> None:
        """Before the run's last meeting: ranks that finish stop beating, too."""
        self.stopped.set()

    def _watch(self) -> None:
        from rft.runtime.pulse import PULSE_S

        while not self.stopped.wait(PULSE_S):
            try:
                for rank, how in self.gone().items():
                    if not self.stopped.is_set() and not self.store.check([f"{LOST}/{rank}"]):
                        print(f"rft: {how}; the run goes on without it (rollout.on_engine_failure=continue)", flush=True)
                        mark_lost(self.store, rank, how)
            except Exception as err:  # noqa: BLE001 - the store is going down with the run: nothing left to watch
                print(f"rft: stopped watching the engines' pulses: {err}", flush=True)
                return

    def gone(self) -> dict[int, str]:
        """rank -> how it went, for the watched ranks whose pulse stopped or that are cut off."""
        from rft.runtime.pulse import SILENT_S, cut_message, cut_off, pid_path, silent_s

        found = {}
        for rank in sorted(self.ranks):
            quiet, cut = silent_s(pid_path(self.run_dir, rank)), cut_off(pid_path(self.run_dir, rank))
            if quiet is not None and quiet >= SILENT_S:
                found[rank] = (f"{self.name_of(rank)} stopped responding: no heartbeat for {quiet:.0f} s (its node "
                               "crashed or lost the network, or it was stopped)")
            elif cut is not None and cut["for_s"] >= SILENT_S:
                found[rank] = cut_message(self.name_of(rank), cut)
        return found
