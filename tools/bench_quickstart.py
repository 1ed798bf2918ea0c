"""Time split per step of the quickstart's GRPO stage: rollout, train, sync, buffer I/O, other.

    python tools/bench_quickstart.py [--sft-steps 800] [--grpo-steps 30] [--out DIR]

Runs the real quickstart (SFT warm-up first, so responses look like a trained model's, then GRPO)
through `python -m rft.launch`, then reads the per-step timings both ranks logged. A GRPO step is
measured on the trainer from the end of one weight sync to the end of the next; `other_s` is what
remains after rollout (generation + reward), train, sync and buffer I/O (explorer write, trainer
read + commit): orchestration, waiting, Python overhead. Sync counts the trainer's send and the
rollout's loading of the weights after the last bucket arrives (vLLM re-processing, cache reset). The first GRPO step is left out (it also
holds the stage-start eval). The last line is one JSON object with the means per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rft.runtime.storage import read_jsonl  # noqa: E402


def step_splits(run_dir: str, stage: str | None = None) -> list[tuple[int, dict[str, float]]]:
    """(step, its time split) for each RL step of a finished run (of `stage` only, if given), from
    the trainer's and the rollout rank's metrics: step_s, rollout_s, train_s, sync_s (the
    trainer's send plus what the rollout does after the last bucket lands), buffer_s (explorer
    write, trainer read + commit) and other_s, the rest."""
    trainer = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "metrics", "trainer0.jsonl"))
               if "timing/step_s" in r and stage in (None, r["stage"])}
    rollout: dict[int, dict] = {}
    for r in read_jsonl(os.path.join(run_dir, "metrics", "rollout1.jsonl")):
        if stage in (None, r["stage"]):
            rollout.setdefault(r["step"], {}).update(r)
    splits = []
    for step in sorted(trainer):
        t, r = trainer[step], rollout[step]
        # with sync.offset > 0 a step may send or load no weights (none published at that point)
        row = {"step_s": t["timing/step_s"], "rollout_s": r["timing/rollout_s"], "train_s": t["timing/train_s"],
               "sync_s": t.get("timing/sync_s", 0.0) + r.get("timing/weight_apply_s", 0.0),
               "buffer_s": t["timing/buffer_read_s"] + r["timing/buffer_write_s"]}
        row["other_s"] = row["step_s"] - sum(v for k, v in row.items() if k != "step_s")
        splits.append((step, row))
    return splits


def print_splits(splits: list[tuple[int, dict[str, float]]], label: str = "step", digits: int = 3) -> None:
    """One row per step of `step_splits`, a column per part of the step."""
    columns = ("step_s", "rollout_s", "train_s", "sync_s", "buffer_s", "other_s")
    print(f"{label:>8} " + " ".join(f"{k[:-2]:>8}" for k in columns))
    for step, row in splits:
        print(f"{step:>8} " + " ".join(f"{row[k]:>8.{digits}f}" for k in columns), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rft-bench-")
    cmd = [sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local", f"run.output_dir={out}",
           "monitor.progress=false", "monitor.eval_interval=0",
           f"stages.0.trainer.max_steps={args.sft_steps}", f"stages.1.trainer.max_steps={args.grpo_steps}"]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    splits = step_splits(out, stage="grpo")[1:]
    print_splits(splits)
    rows = [row for _, row in splits]
    means = {k: sum(row[k] for row in rows) / len(rows) for k in rows[0]}
    print(f"other_s is {100 * means['other_s'] / means['step_s']:.1f}% of step_s "
          f"over {len(rows)} GRPO steps (run dir {out})")
    print(json.dumps({k: round(v, 4) for k, v in means.items()}))


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/bench_quickstart.py")  # whatever main starts ends with it
