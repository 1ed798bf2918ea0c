"""mode=serve: rollout ranks that only serve the policy to agents outside the run.

    start the engine and vLLM's OpenAI server on it (rft/explorer/openai_endpoint.py)
    every serve.step_s:
        write the sessions agents rewarded since the last step as this engine's shard of step k
        load the newest weights a trainer published to sync.checkpoint_dir, if they are newer
    until serve.duration_min has passed or the job is stopped (Ctrl-C, scancel, the time limit);
    then write what was rewarded meanwhile, and end

The weights come from the checkpoint engine (rft/weights/engines.py): a run with
`sync.engine=checkpoint sync.checkpoint_dir=D` publishes version v as D/v<v>/ at every sync, and a
serve job with the same `sync.checkpoint_dir=D` loads each new complete version; calls in flight
finish on the weights they started with (RolloutEngine.updating_weights drains them first), and
every recorded call carries its version. Relaunched into the same run.output_dir, a serve job goes
on where it stopped: its shards continue after the last step each engine wrote.
"""

from __future__ import annotations

import os
import time

from rft.buffer.experience import to_table
from rft.buffer.shards import ExperienceBuffer
from rft.config import RFTConfig
from rft.explorer.dealer import Dealer
from rft.explorer.openai_endpoint import rewarded_experiences, serve_endpoint
from rft.explorer.vllm_engine import LoopThread, RolloutEngine
from rft.runtime.monitor import Monitor, rank_summary_path, write_json_atomic
from rft.runtime.storage import read_jsonl
from rft.runtime.preemption import ControlGroup, StopFlag
from rft.runtime.topology import Topology
from rft.weights.engines import newest_complete_version, version_dir


def run_server(cfg: RFTConfig, topology: Topology, control: ControlGroup, stop: StopFlag) -> dict:
    started = time.time()
    index = topology.engine_index
    stop.ignore_in_children()  # vLLM's engine process must survive Slurm's SIGUSR2
    engine = RolloutEngine(cfg.model, cfg.rollout, cfg.seed + topology.rank, topology.context_length,
                           name=f"engine {index}", loop=LoopThread())
    stop.install()
    endpoint = serve_endpoint(cfg, engine, Dealer(control.store, index, topology.engine_count, cfg.sync.timeout_s), index)
    buffer = ExperienceBuffer.for_run(cfg)
    monitor = Monitor(cfg, f"serve{topology.rank}")
    step = next_step(buffer.root, topology.rank)
    totals = {"sessions": 0, "rows": 0, "weight_loads": 0}

    def write_rewarded() -> dict[str, float]:
        """The sessions rewarded since the last call, as this engine's shard of the next step."""
        nonlocal step
        rows = rewarded_experiences(endpoint)
        if not rows:
            return {}
        buffer.write(to_table(rows), step=step, producer=topology.rank, version=engine.version)
        sessions = len({r.trajectory_id for r in rows})
        totals["sessions"] += sessions
        totals["rows"] += len(rows)
        step += 1
        return {"serve/sessions": float(sessions), "serve/reward": sum(r.reward for r in rows) / len(rows)}

    # serve.duration_min counts from when agents can reach the endpoint, not from the engine's start
    deadline = time.time() + cfg.serve.duration_min * 60 if cfg.serve.duration_min else float("inf")
    try:
        while not (stop.requested or time.time() >= deadline):
            time.sleep(min(cfg.serve.step_s, max(deadline - time.time(), 0.0)))
            scalars = {"serve/version": float(engine.version), **write_rewarded()}
            if cfg.sync.checkpoint_dir:
                scalars.update(load_newer_weights(engine, cfg.sync.checkpoint_dir))
                totals["weight_loads"] += int("serve/weight_load_s" in scalars)
            monitor.log(step, scalars, "serve")
    except KeyboardInterrupt:  # Ctrl-C of a local launch: its cancel gives the ranks about a second
        pass
    finally:
        monitor.log(step, write_rewarded(), "serve")  # what was rewarded since the last step is kept
        monitor.close()
    endpoint.close()
    summary = {"rank": topology.rank, "role": "rollout", "mode": "serve", "steps": step, "version": engine.version,
               "wall_s": time.time() - started, **totals}
    write_json_atomic(rank_summary_path(cfg.run.output_dir, topology.rank), summary)
    print(f"engine {index}: served {totals['sessions']} rewarded session(s) into {step} shard(s); "
          f"weights version {engine.version}", flush=True)
    control.any(False)  # rank 0 hosts the store: every engine is done with it
    if topology.rank == 0:
        control.finish()
    return summary


def next_step(buffer_root: str, producer: int) -> int:
    """The step after the last one `producer` wrote to this buffer (0 for a new run)."""
    steps = [e["step"] for e in read_jsonl(os.path.join(buffer_root, "manifest.jsonl")) if e["producer"] == producer]
    return max(steps, default=-1) + 1


def load_newer_weights(engine: RolloutEngine, checkpoint_dir: str) -> dict[str, float]:
    """Load the newest complete version in `checkpoint_dir` if it is newer than the engine's."""
    newest = newest_complete_version(checkpoint_dir)
    if newest <= engine.version:
        return {}
    start = time.time()
    if not load_version(engine, checkpoint_dir, newest):
        return {}
    print(f"{engine.name}: serving weights version {newest} from {checkpoint_dir}", flush=True)
    return {"serve/weight_load_s": time.time() - start, "serve/version": float(newest)}


def load_version(engine: RolloutEngine, checkpoint_dir: str, version: int) -> bool:
    """Serve the checkpoint engine's `version` from now on; False if the writer pruned it while it
    loaded (it keeps the newest two: a newer one is there to load instead)."""
    path = version_dir(checkpoint_dir, version)
    try:
        engine.load_hf_dir(path, version)
    except Exception:
        if os.path.isdir(path):
            raise
        print(f"{engine.name}: weights version {version} vanished while loading; loading a newer one next", flush=True)
        return False
    return True
