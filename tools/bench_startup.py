"""Where a local run's start and end go: the tiny quickstart launched a few times, split in parts.

    python tools/bench_startup.py [--runs 4] [--out DIR] [--no-rank-server]

Each run is `python -m rft.launch +experiment=quickstart` with 4 SFT and 3 GRPO steps, as a user
types it. The first run may start the rank server (rft/runtime/rank_server.py: it imports torch,
megatron-core, transformers and vLLM once); it is reported apart as `cold`, and the targets are
checked on the median of the others, the runs a user makes after the first. Parts, in seconds:

    launcher_s      the launcher's start to its "submitted job" line (compose, validate, plan, submit)
    task_start_s    submitted to each task's first log line (submitit's controller, the rank server's fork)
    trainer_build_s the trainer's model built and its weights loaded (its summary's startup_s)
    engine_start_s  the rollout rank's vLLM engine up (its summary's startup_s)
    first_step_s    submitted to the trainer's first step logged (after the stage-start evaluation)
    end_s           the run's last work (last step or final evaluation) to the launcher's summary line

Targets (issue 47, this 2-core machine): launcher_s <= 1.5, first_step_s <= 8, end_s <= 1. The last
line is one JSON object: medians, the cold run, the targets and whether each was met.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rft.runtime.storage import read_jsonl  # noqa: E402

TARGETS = {"launcher_s": 1.5, "first_step_s": 8.0, "end_s": 1.0}
_SUBMITIT_START = re.compile(r"submitit INFO \((.+?)\) - Starting with JobEnvironment")


def launch(run_dir: str, *overrides: str) -> dict[str, float]:
    """One timed launch: the absolute time each launcher line appeared, and when it started."""
    started = time.time()
    launcher = subprocess.Popen([sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local",
                                 f"run.output_dir={run_dir}", "stages.0.trainer.max_steps=4",
                                 "stages.1.trainer.max_steps=3", "monitor.progress=false", "monitor.plots=false",
                                 *overrides],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {"start": started}
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if line.startswith("submitted job"):
            seen["submitted"] = time.time()
        elif "rft run summary" in line:
            seen["summary"] = time.time()
    if launcher.wait() != 0 or "summary" not in seen:
        sys.exit(f"the launch into {run_dir} failed:\n{''.join(lines[-40:])}")
    return seen


def parts(run_dir: str, seen: dict[str, float]) -> dict[str, float]:
    """The split of one finished run (see the module doc)."""
    logs = os.path.join(run_dir, "logs")
    task_starts = []
    for name in sorted(os.listdir(logs)):
        if not name.endswith("_log.out"):
            continue
        with open(os.path.join(logs, name)) as f:
            text = f.read()
        start = _SUBMITIT_START.search(text)
        stamp = datetime.datetime.strptime(start.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        task_starts.append(stamp)
    summaries = [json.load(open(os.path.join(run_dir, "metrics", f"summary-rank{r}.json"))) for r in (0, 1)]
    steps = read_jsonl(os.path.join(run_dir, "metrics", "trainer0.jsonl"))
    last_work = max(steps[-1]["time"], os.path.getmtime(os.path.join(run_dir, "metrics", "eval.jsonl")))
    return {"launcher_s": seen["submitted"] - seen["start"],
            "task_start_s": max(task_starts) - seen["submitted"],
            "trainer_build_s": summaries[0]["startup_s"],
            "engine_start_s": summaries[1]["startup_s"],
            "first_step_s": steps[0]["time"] - seen["submitted"],
            "end_s": seen["summary"] - last_work}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="launches; the first is reported as cold")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--no-rank-server", action="store_true",
                        help="start every rank as a fresh interpreter (cluster.rank_server_idle_min=0), to compare")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rft-bench-startup-")
    rows = []
    for index in range(args.runs):
        run_dir = os.path.join(out, f"run{index}")
        row = parts(run_dir, launch(run_dir, *(["cluster.rank_server_idle_min=0"] if args.no_rank_server else [])))
        rows.append(row)
        print(f"run {index}{' (cold)' if index == 0 else ''}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()),
              flush=True)
    warm = rows[1:] or rows
    median = {key: round(statistics.median(r[key] for r in warm), 2) for key in rows[0]}
    met = {key: median[key] <= target for key, target in TARGETS.items()}
    print("median of the warm runs: " + "  ".join(f"{k} {v:.2f}" for k, v in median.items()))
    print("targets: " + "  ".join(f"{k} <= {t} {'met' if met[k] else 'MISSED'}" for k, t in TARGETS.items()))
    print(json.dumps({"rank_server": not args.no_rank_server, "median": median, "cold": {k: round(v, 2) for k, v in rows[0].items()}, "targets": TARGETS,
                      "met": met, "runs": len(rows), "cores": os.cpu_count()}))


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/bench_startup.py")  # whatever main starts ends with it
