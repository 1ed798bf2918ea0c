"""rollout.on_engine_failure=restart: a rollout rank's vLLM engine that died (its engine core process
gone: a GPU's Xid error, an out-of-memory kill) or stalled (requests in flight and none finished for
rollout.engine_stall_s: its engine core is killed then) is started again on the rank's devices,
serves the weights it served, and the batch it was running is taken up again:

    try:    run the batch (this engine's share of it, rft/explorer/dealer.py)
    except  the engine died:
        restart it: vLLM started again, the weights of the last sync loaded from the copy the
                    engine kept as they arrived (rft/explorer/vllm_worker.py's WeightCopy)
        count it:   in the control store (rft/runtime/membership.py); the next sync forms its weight
                    groups anew (a new process takes the restarted engine's place in them)
        run the batch again: requests the step's generation journal recorded (rft/explorer/journal.py)
                    come back from it; the tasks the dead attempt had taken from a batch the job's
                    engines share are dealt again at the batch's end, as a lost engine's are

At most rollout.max_engine_restarts per rank; one failure more ends the job as `fail` does.

Why the engine's own copy rather than the trainer sending again: the trainer may have trained on
since its last sync (sync.interval > 1, sync.offset), so its weights are no longer the version the
engine served, and a resend would need every exporting trainer rank to gather at the same moment,
from inside its wait for experience. The copy is exactly the version served, on the node's own
storage; its cost is one host copy and write per sync, paid only with `restart`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time

from rft.config import RFTConfig
from rft.explorer.vllm_engine import RolloutEngine
from rft.runtime.control import Runtime
from rft.runtime.membership import count_restart
from rft.runtime.topology import Topology


def weights_copy_root(topology: Topology) -> str:
    """Node-local storage for a rank's copies of the weights (TMPDIR, as batch systems set it to
    the node's scratch): a restart reads them on the node that wrote them."""
    job = os.environ.get("SLURM_JOB_ID", f"local{os.getpid()}")
    return os.path.join(tempfile.gettempdir(), f"rft-weights-{job}-rank{topology.rank}")


class EngineRestarts:
    """A rollout rank's engine restarts (none unless rollout.on_engine_failure=restart), and the
    watch that kills a stalled engine's core so that its requests fail and it is restarted."""

    def __init__(self, cfg: RFTConfig, topology: Topology, runtime: Runtime, engines: list[RolloutEngine]):
        self.engines, self.runtime = engines, runtime
        self.allowed = cfg.rollout.max_engine_restarts if cfg.rollout.on_engine_failure == "restart" else 0
        self.used, self.stall_s = 0, cfg.rollout.engine_stall_s
        self.stalled: dict[str, float] = {}  # engine name -> when its core was killed for a stall
        self.root = weights_copy_root(topology) if self.allowed else None
        self._closed = threading.Event()
        if not self.allowed:
            return
        for index, engine in enumerate(engines):
            engine.keep_weights_in = os.path.join(self.root, f"engine{index}")
        threading.Thread(target=self._watch_stalls, name="rft-engine-stall-watch", daemon=True).start()

    def _watch_stalls(self) -> None:
        while not self._closed.wait(1.0):
            for engine in self.engines:
                quiet = time.monotonic() - engine.last_progress
                if engine.llm is None or not engine.in_flight or quiet <= self.stall_s:
                    continue
                self._kill_stalled(engine, f"{engine.in_flight} request(s) in flight and none finished for {quiet:.0f}s")
                engine.last_progress = time.monotonic()  # one kill per stall

    def _kill_stalled(self, engine: RolloutEngine, why: str) -> None:
        """Kill a stalled engine's core (a stopped process too): vLLM then fails its requests and
        calls, and the engine is restarted as one that died."""
        pids = engine.core_pids()
        print(f"rft: {engine.name} stalled: {why} (rollout.engine_stall_s={self.stall_s:g}); killing its engine core "
              f"(pid {', '.join(map(str, pids)) or 'gone'})", flush=True)
        self.stalled[engine.name] = time.monotonic()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def lost_after(self, batch: str) -> list[str]:
        """At the end of `batch`, before its shard lets the trainer go on to a weight sync that
        would wait for a lost engine until sync.timeout_s: why each engine is lost whose core died
        after the batch's last answer or no longer answers (a hang with nothing in flight, which
        the stall watch cannot see; its core is killed). Empty when every engine is well."""
        if not self.allowed:
            return []
        lost = []
        for engine in self.engines:
            answered = not engine.died() and engine.answers(self.stall_s)
            if answered:
                continue
            if engine.died():  # dead before the call, or the call found it dead
                lost.append(f"{engine.name} died after batch {batch}'s last answer")
            else:
                self._kill_stalled(engine, f"no answer for {self.stall_s:g}s after batch {batch}'s last answer")
                lost.append(f"{engine.name} stopped answering after batch {batch}'s last answer")
        return lost

    def recover(self, failure: BaseException) -> bool:
        """After an engine failure in a batch: restart the engines and say so, or False when no
        restart is left (the failure then ends the job)."""
        if self.used >= self.allowed:
            if self.allowed:
                print(f"rft: engine failed again after {self.used} restart(s) (rollout.max_engine_restarts="
                      f"{self.allowed}): the job ends", flush=True)
            return False
        self.used += 1
        for engine in self.engines:
            how = "stalled" if engine.name in self.stalled else "died"
            print(f"rft: {engine.name} {how} ({type(failure).__name__}: {str(failure)[:200]}); restarting it "
                  f"({self.used} of rollout.max_engine_restarts={self.allowed})", flush=True)
            started = time.time()
            engine.restart()
            self.stalled.pop(engine.name, None)
            print(f"rft: {engine.name} restarted in {time.time() - started:.1f}s, serving version {engine.version}"
                  f"{' (weights kept at its last sync)' if engine.restore_from else ' (the model it started from)'}",
                  flush=True)
        count_restart(self.runtime.group.store)
        self.runtime.progress.add(engine_restarts=1)
        return True

    def close(self) -> None:
        self._closed.set()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
