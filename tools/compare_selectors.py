"""Which task selector reaches a held-out accuracy in fewer GRPO steps (issue: data pipelines).

    python tools/compare_selectors.py                      # quickstart: shuffle vs difficulty, 3 seeds
    python tools/compare_selectors.py --selectors shuffle difficulty curriculum --seeds 0 1

Runs the quickstart's SFT warm-up once (its HF export is the starting point of every GRPO run, so
all selectors start from the same weights), then the quickstart's GRPO stage once per selector
and seed, evaluating every --eval-every steps. For each run it prints the accuracy curve and the
first step at which accuracy reaches --target (default: the shuffle runs' mean final accuracy,
the bar the others must reach sooner). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_STEPS = 2000  # the quickstart's warm-up (conf/experiment/quickstart.yaml)


def launch(overrides: list[str], log: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local",
                               "monitor.progress=false", *overrides], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"compare_selectors: a run failed; see {log}")


def warm_up(root: str) -> str:
    """The SFT stage alone, exported as an HF model; its directory (made once, then reused)."""
    base = os.path.join(root, "sft")
    if not glob.glob(os.path.join(base, "checkpoints", "hf", "v*", "config.json")):
        print(f"SFT warm-up ({SFT_STEPS} steps) -> {base}/checkpoints/hf", flush=True)
        launch([f"run.output_dir={base}", "run.resume=never", "trainer.save_hf=true", f"trainer.save_interval={SFT_STEPS}",
                "stages=[{name: sft, algorithm: {name: sft, policy_loss: sft, lr: 3.0e-3, warmup_steps: 20}, "
                f"trainer: {{max_steps: {SFT_STEPS}, sft_batch_size: 64}}}}]"], os.path.join(root, "sft.log"))
    return base


def export_of(base: str) -> str:
    """The warm-up's HF export (<base>/checkpoints/hf/v<step>, the newest)."""
    return max(glob.glob(os.path.join(base, "checkpoints", "hf", "v*")))


def grpo(root: str, base: str, selector: str, seed: int, steps: int, eval_every: int) -> dict[int, float]:
    """One GRPO stage from the warm-up's weights; held-out accuracy by GRPO step (0: the start)."""
    run = os.path.join(root, f"{selector}-seed{seed}")
    if not os.path.exists(os.path.join(run, "metrics", "summary-rank0.json")):
        print(f"GRPO {steps} steps, data.selector.name={selector}, seed {seed}", flush=True)
        launch([f"run.output_dir={run}", "run.resume=never", f"seed={seed}",
                f"model.path={export_of(base)}", "model.tiny=null", "data.arithmetic=null",
                f"data.train_path={base}/data/train.jsonl", f"data.eval_path={base}/data/eval.jsonl",
                f"monitor.eval_interval={eval_every}", f"data.selector.name={selector}",
                f"stages=[{{name: grpo, algorithm: {{name: grpo, lr: 3.0e-4, clip_eps: 0.2}}, "
                f"trainer: {{max_steps: {steps}}}}}]"], run + ".log")
    with open(os.path.join(run, "metrics", "eval.jsonl")) as f:
        return {row["step"]: row["accuracy"] for row in map(json.loads, f)}


def first_reaching(curve: dict[int, float], target: float) -> int | None:
    return next((step for step in sorted(curve) if curve[step] >= target - 1e-9), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--selectors", nargs="+", default=["shuffle", "difficulty"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=None, help="accuracy to reach (default: shuffle's final)")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "compare_selectors"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    base = warm_up(args.out)
    curves = {(sel, seed): grpo(args.out, base, sel, seed, args.steps, args.eval_every)
              for sel in args.selectors for seed in args.seeds}
    finals = {key: curve[max(curve)] for key, curve in curves.items()}
    shuffle = [finals[(s, seed)] for s, seed in finals if s == "shuffle"]
    target = args.target if args.target is not None else (sum(shuffle) / len(shuffle) if shuffle else 0.9)
    steps = sorted({step for curve in curves.values() for step in curve})
    print(f"\nheld-out accuracy by GRPO step (target {target:.3f}: {'--target' if args.target else 'shuffle mean final'})")
    print("selector     seed " + " ".join(f"{s - SFT_STEPS if s > SFT_STEPS else s:>6}" for s in steps))
    result = {"target": target, "runs": {}}
    for (sel, seed), curve in curves.items():
        print(f"{sel:<12} {seed:>4} " + " ".join(f"{curve.get(s, float('nan')):6.3f}" for s in steps))
        reached = first_reaching(curve, target)
        result["runs"][f"{sel}/{seed}"] = {"final": finals[(sel, seed)], "best": max(curve.values()),
                                           "reached_at": reached - SFT_STEPS if reached else None}
    for sel in args.selectors:
        runs = [result["runs"][f"{sel}/{seed}"] for seed in args.seeds]
        reached = [r["reached_at"] for r in runs]
        result[sel] = {"mean_final": sum(r["final"] for r in runs) / len(runs),
                       "mean_best": sum(r["best"] for r in runs) / len(runs),
                       "reached_target_at": reached}
        print(f"{sel}: mean final {result[sel]['mean_final']:.3f}, reached target at GRPO steps {reached}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
