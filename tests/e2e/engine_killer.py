"""A reward for tests/e2e/test_engines.py: `exact_match`, except that rollout rank
$RFT_KILL_RANK kills itself with SIGKILL while it generates, once the trainer has done
$RFT_KILL_AFTER_STEP steps: an engine lost mid-step at a known moment, once per run directory."""

import json
import os
import signal

import submitit

from rft.explorer.rewards import exact_match


async def exact_match_then_die(trajectory, task) -> float:
    run_dir = os.environ["RFT_KILL_RUN_DIR"]
    if submitit.JobEnvironment().global_rank == int(os.environ["RFT_KILL_RANK"]):
        try:
            with open(os.path.join(run_dir, "progress.json")) as f:
                step = json.load(f)["step"]
        except (OSError, ValueError):
            step = 0
        marker = os.path.join(run_dir, "killed-engine")
        if step >= int(os.environ["RFT_KILL_AFTER_STEP"]) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # this rank's process: its vLLM engine goes with its group
    return exact_match(trajectory, task)
