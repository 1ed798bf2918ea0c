"""A rank's pulse: a daemon thread touches the rank's pid file every PULSE_S seconds.

A rank that hangs because a peer stopped (SIGSTOP, a debugger, a node that stopped answering)
fails with a timeout naming the peer it waited for, which may itself be waiting for another. The
launcher, reading the pulses when a rank fails, names the rank that went silent while its process
lived: that one stopped, the others only waited. Why a thread and a file: a stopped process stops
all its threads, a rank blocked in a collective does not (torch releases the GIL while it waits),
and the run directory is on the filesystem every node and the login node share.
"""

from __future__ import annotations

import os
import threading
import time

PULSE_S = 5.0
SILENT_S = 4 * PULSE_S  # no pulse for this long: the rank is not running


def start_pulse(path: str) -> None:
    """Touch `path` every PULSE_S seconds for as long as this process runs."""

    def beat() -> None:
        while True:
            try:
                os.utime(path)
            except OSError:
                pass  # the run directory went away (the job is being cleaned up)
            time.sleep(PULSE_S)

    threading.Thread(target=beat, name="rft-pulse", daemon=True).start()


def silent_s(path: str) -> float | None:
    """Seconds since `path`'s last pulse (None: no such file)."""
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return None
