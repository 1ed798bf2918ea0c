"""Wall time per GRPO step of the quickstart, synchronous against pipelined/asynchronous schedules.

    python tools/bench_async.py [--sft-steps 200] [--grpo-steps 20]
        [--settings 0:1 1:1 2:2 colocated free:2 free:2:partial] [-- overrides]

Each setting `offset:interval` runs the real quickstart (`python -m rft.launch`, an SFT warm-up
so responses look like a trained model's, then GRPO) with `sync.offset` and `sync.interval`, and
reads the trainer's logged step times; `colocated` runs it synchronously with
`cluster.colocate=true` (the roles take turns on shared devices, vLLM asleep while the trainer
trains); `free:S` runs it free-running (`sync.free_run=true`, `buffer.max_staleness=S`: the
explorer never meets the trainer's steps and stays within S steps of staleness), and
`free:S:partial` adds `rollout.partial_rollout=true` (weight updates cut generations, which go on
with the new weights). A step is measured on the trainer from the end of one step
to the end of the next; the first two GRPO steps are left out (stage-start eval, pipeline fill).
Prints one JSON object per setting: mean step seconds, the trainer's train and the explorer's
rollout seconds per step, their overlap (the share of the wall both were busy, at least:
(train + rollout - wall) / wall over the measured steps), speed-up over the first setting, and the
mean and max `policy/version_lag` (trainer steps between the weights that generated a shard and
its training step). Where the roles share few cores (a laptop, CI) overlap buys little: both
compete for the same cores; on a GPU node each role has its own devices.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rft.runtime.storage import read_jsonl  # noqa: E402


def run(sft_steps: int, grpo_steps: int, setting: str, out: str, extra: list[str]) -> dict:
    colocated, free = setting == "colocated", setting.startswith("free:")
    offset, interval = (0, 1) if colocated or free else (int(x) for x in setting.split(":"))
    if free:
        extra = ["sync.free_run=true", f"buffer.max_staleness={setting.split(':')[1]}",
                 f"rollout.partial_rollout={str(setting.endswith(':partial')).lower()}", *extra]
    cmd = [sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local", f"run.output_dir={out}",
           "monitor.progress=false", "monitor.eval_interval=0", f"stages.0.trainer.max_steps={sft_steps}",
           f"stages.1.trainer.max_steps={grpo_steps}", f"sync.offset={offset}", f"sync.interval={interval}",
           f"cluster.colocate={str(colocated).lower()}", *extra]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rows = [r for r in read_jsonl(os.path.join(out, "metrics", "trainer0.jsonl")) if r["stage"] == "grpo"][2:]
    steps = {r["step"] for r in rows}
    explored = [r for r in read_jsonl(os.path.join(out, "metrics", "rollout1.jsonl"))
                if r["stage"] == "grpo" and r["step"] in steps and "timing/rollout_s" in r]
    wall, train = sum(r["timing/step_s"] for r in rows), sum(r["timing/train_s"] for r in rows)
    rollout = sum(r["timing/rollout_s"] for r in explored)
    lags = [r["policy/version_lag"] for r in rows]
    return {"setting": setting, "offset": offset, "interval": interval, "steps_measured": len(rows),
            "step_s": wall / len(rows), "train_s": train / len(rows), "rollout_s": rollout / len(explored),
            # the share of the wall both roles were busy at least: what of their work the schedule overlaps
            "overlap": max(0.0, train + rollout - wall) / wall,
            "version_lag_mean": sum(lags) / len(lags), "version_lag_max": max(lags)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--grpo-steps", type=int, default=20)
    parser.add_argument("--settings", nargs="+", default=["0:1", "1:1", "2:2", "colocated", "free:2", "free:2:partial"],
                        help="offset:interval pairs, colocated, or free:<max_staleness>[:partial]")
    parser.add_argument("overrides", nargs="*", help="more launcher overrides for every run, e.g. trainer.threads=1")
    args = parser.parse_args()
    baseline = None
    for setting in args.settings:
        if setting != "colocated" and not re.fullmatch(r"\d+:\d+|free:\d+(:partial)?", setting):
            sys.exit(f"--settings: {setting!r} is neither offset:interval (e.g. 1:1), colocated nor "
                     "free:<staleness>[:partial]")
        result = run(args.sft_steps, args.grpo_steps, setting, tempfile.mkdtemp(prefix="rft-bench-async-"),
                     args.overrides)
        baseline = baseline or result["step_s"]
        result["speedup"] = baseline / result["step_s"]
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/bench_async.py")  # whatever main starts ends with it
