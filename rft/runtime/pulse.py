"""A rank's pulse: a daemon thread touches the rank's pid file every PULSE_S seconds and, on a
rank whose rank 0 runs on another node, checks that rank 0's control store still answers.

A rank that hangs because a peer stopped (SIGSTOP, a debugger, a node that stopped answering)
fails with a timeout naming the peer it waited for, which may itself be waiting for another. The
launcher, reading the pulses when a rank fails, names the rank that went silent while its process
lived: that one stopped, the others only waited. Why a thread and a file: a stopped process stops
all its threads, a rank blocked in a collective does not (torch releases the GIL while it waits),
and the run directory is on the filesystem every node and the login node share.

A network partition is the other way round: the cut-off rank lives and beats (where the shared
filesystem is reached by another network, or not cut yet), but its peers wait for it in vain.
Its pulse then writes `<pid file>.cut` (how long rank 0 has not answered, and the error), so the
launcher names the node that lost the network rather than only the rank that timed out waiting.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

PULSE_S = 5.0
SILENT_S = 4 * PULSE_S  # no pulse for this long: the rank is not running


def pid_path(run_dir: str, rank: int, supervisor: bool = False) -> str:
    """The rank's process id (kill it to kill the rank), or its supervising task's; its mtime is
    the rank's pulse."""
    return os.path.join(run_dir, "pids", f"rank{rank}{'.supervisor' if supervisor else ''}.pid")


def cut_path(path: str) -> str:
    return path + ".cut"


class Pulse:
    """Touches the pid file every PULSE_S seconds for as long as this process runs; once
    `reach` is set (rank 0's control store, address and port, after it first answered), also
    connects to it and keeps cut_path up to date."""

    def __init__(self, path: str):
        self.path, self.reach = path, None
        try:
            os.remove(cut_path(path))  # an earlier attempt's (a requeued job)
        except OSError:
            pass
        threading.Thread(target=self._beat, name="rft-pulse", daemon=True).start()

    def _beat(self) -> None:
        answered = time.monotonic()
        while True:
            try:
                os.utime(self.path)
            except OSError:
                pass  # the run directory went away (the job is being cleaned up)
            if self.reach is not None:
                answered = _check_reach(self.path, self.reach, answered)
            time.sleep(PULSE_S)


def _check_reach(path: str, reach: tuple[str, int], answered: float) -> float:
    """Connect to `reach`; returns when it last answered. A plain TCP connect is enough: the store
    accepts in a thread of its own, so a busy or blocked rank 0 still answers, a cut network does
    not (a timeout, or no route), and a refused connection means rank 0's node is reachable."""
    try:
        with socket.create_connection(reach, timeout=PULSE_S):
            pass
    except ConnectionRefusedError:
        pass  # rank 0's node answered: the network is up, rank 0 has ended
    except OSError as err:
        record = {"address": f"{reach[0]}:{reach[1]}", "for_s": round(time.monotonic() - answered, 1),
                  "error": str(err) or type(err).__name__}
        try:
            with open(cut_path(path) + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(cut_path(path) + ".tmp", cut_path(path))
        except OSError:
            pass
        return answered
    try:
        os.remove(cut_path(path))
    except OSError:
        pass
    return time.monotonic()


def cut_message(who: str, cut: dict) -> str:
    """How a rank cut off from rank 0 is named (`cut`: what cut_off returned)."""
    return (f"{who} lost the network to rank 0: its control store at {cut['address']} has not answered it for "
            f"{cut['for_s']:.0f} s")


def silent_s(path: str) -> float | None:
    """Seconds since `path`'s last pulse (None: no such file)."""
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return None


def cut_off(path: str) -> dict | None:
    """What the rank of pid file `path` last said about its rank 0 not answering ({"address",
    "for_s", "error"}), if it said so within SILENT_S; None while rank 0 answers it."""
    quiet = silent_s(cut_path(path))
    if quiet is None or quiet > SILENT_S:
        return None
    try:
        with open(cut_path(path)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
