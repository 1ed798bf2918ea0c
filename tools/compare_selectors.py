"""Which task selector reaches a held-out accuracy in fewer GRPO steps (issue: data pipelines).

    python tools/compare_selectors.py                      # quickstart: shuffle vs difficulty, 3 seeds
    python tools/compare_selectors.py --taskset easy_heavy # most tasks already solved (below)
    python tools/compare_selectors.py --selectors shuffle difficulty curriculum --seeds 0 1
    python tools/compare_selectors.py --taskset sparse \
        --selectors shuffle difficulty:weighting=variance,prior_samples=0  # data.selector options

Runs the quickstart's SFT warm-up once (its HF export is the starting point of every GRPO run, so
all selectors start from the same weights), then the quickstart's GRPO stage once per selector
and seed, evaluating every --eval-every steps. For each run it prints the accuracy curve, the share
of GRPO groups with a reward spread (what a selector can raise), and the first step at which
accuracy reaches --target (default: the shuffle runs' mean final accuracy,
the bar the others must reach sooner). Last line: one JSON object.

Tasksets: `quickstart` (its 5000 training problems; after the earlier recipe's 2000-step warm-up
the model solved 84% of them) and `easy_heavy`, the same problems reduced to every one without a carry (which the
warm-up model nearly always solves) and the first EASY_HEAVY_HARD with carries: a taskset most of
whose tasks teach nothing any more, the case difficulty-aware selection is for (a strong model on
GSM8K); `small`, its first SMALL problems, so that 100 steps are 8 epochs and a selector chooses
among tasks it has all seen (the regime of many epochs over a fixed taskset); `noisy`, every
other problem's answer made wrong (noisy labels: tasks no policy solves, whose groups teach
nothing); `sparse`, its first SPARSE problems with four in five answers made wrong, so that one
group in ten has a reward spread under shuffle; `sources`, all 5000 problems with the same four
in five made wrong and a `source` column naming which (clean, broken), as when one source of a mixed
dataset has broken labels: `difficulty:group_key=source` can learn which source teaches. All
evaluate on the quickstart's held-out set.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe_warm_up() -> tuple[int, int]:
    """The quickstart recipe's SFT warm-up (conf/experiment/quickstart.yaml): steps, rows a step.
    The tables in docs/guides/benchmarks.md were measured with the earlier recipe's 2000 steps of
    64 rows: --sft-steps 2000 --sft-rows 64 runs that again."""
    with open(os.path.join(REPO, "conf", "experiment", "quickstart.yaml")) as f:
        sft = next(s for s in yaml.safe_load(f)["stages"] if s["name"] == "sft")
    return sft["trainer"]["max_steps"], sft["trainer"]["sft_batch_size"]


SFT_STEPS, SFT_ROWS = recipe_warm_up()
EASY_HEAVY_HARD = 300  # problems with carries kept in the easy_heavy taskset (~1500 have none)
SMALL = 400  # problems in the small taskset
SPARSE = 1000  # problems in the sparse taskset
CLEAN_EVERY = 5  # sparse, sources: every fifth problem keeps its true answer


def launch(overrides: list[str], log: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local",
                               "monitor.progress=false", *overrides], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"compare_selectors: a run failed; see {log}")


def warm_up(root: str, steps: int, rows: int) -> str:
    """The SFT stage alone, exported as an HF model; its directory (made once, then reused)."""
    base = os.path.join(root, "sft" if (steps, rows) == (SFT_STEPS, SFT_ROWS) else f"sft{steps}x{rows}")
    if not glob.glob(os.path.join(base, "checkpoints", "hf", "v*", "config.json")):
        print(f"SFT warm-up ({steps} steps) -> {base}/checkpoints/hf", flush=True)
        launch([f"run.output_dir={base}", "run.resume=never", "trainer.save_hf=true", f"trainer.save_interval={steps}",
                "stages=[{name: sft, algorithm: {name: sft, policy_loss: sft, lr: 3.0e-3, warmup_steps: 20}, "
                f"trainer: {{max_steps: {steps}, sft_batch_size: {rows}}}}}]"], base + ".log")
    return base


def run_dir(root: str, base: str, train: str, selector: str, seed: int) -> str:
    selector = selector.replace(":", "-").replace(",", "-").replace("=", "")  # difficulty-weightingvariance
    name = os.path.splitext(os.path.basename(train))[0]
    prefix = "" if os.path.basename(base) == "sft" else os.path.basename(base) + "-"  # another warm-up
    return os.path.join(root, f"{prefix}{'' if name == 'train' else name + '-'}{selector}-seed{seed}")


def export_of(base: str) -> str:
    """The warm-up's HF export (<base>/checkpoints/hf/v<step>, the newest)."""
    return max(glob.glob(os.path.join(base, "checkpoints", "hf", "v*")))


def _broken(row: dict) -> dict:
    """The row with a wrong answer: a task no policy solves."""
    return dict(row, answer=str(int(row["answer"]) + 7))


def taskset(root: str, base: str, name: str) -> str:
    """The training file of taskset `name` (see the module's docstring)."""
    source = os.path.join(base, "data", "train.jsonl")
    if name == "quickstart":
        return source
    path = os.path.join(root, f"{name}.jsonl")
    with open(source) as f:
        rows = [json.loads(line) for line in f]
    if name == "small":
        kept = rows[:SMALL]
    elif name == "sparse":  # four in five answers wrong: few tasks teach anything
        kept = [r if i % CLEAN_EVERY == 0 else _broken(r) for i, r in enumerate(rows[:SPARSE])]
    elif name == "sources":  # two sources, one with broken answers, named in a column
        kept = [dict(r, source="clean") if i % CLEAN_EVERY == 0 else dict(_broken(r), source="broken")
                for i, r in enumerate(rows)]
    elif name == "noisy":  # every other row's answer is wrong: a task no policy can solve
        kept = [_broken(r) if i % 2 else r for i, r in enumerate(rows)]
    else:
        hard = [r for r in rows if r["difficulty"] > 0][:EASY_HEAVY_HARD]
        kept = [r for r in rows if r["difficulty"] == 0 or r in hard]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return path


def selector_overrides(spec: str) -> list[str]:
    """`name` or `name:key=value,key=value` (e.g. difficulty:weighting=variance,revisit=0.75) as
    data.selector overrides."""
    name, _, options = spec.partition(":")
    return [f"data.selector.name={name}"] + [f"data.selector.{kv}" for kv in options.split(",") if kv]


def grpo(root: str, base: str, train: str, selector: str, seed: int, steps: int, eval_every: int) -> dict[int, float]:
    """One GRPO stage from the warm-up's weights; held-out accuracy by GRPO step (0: the start).
    `selector`: a spec of selector_overrides."""
    run = run_dir(root, base, train, selector, seed)
    if not os.path.exists(os.path.join(run, "metrics", "summary-rank0.json")):
        print(f"GRPO {steps} steps, selector {selector}, seed {seed}", flush=True)
        launch([f"run.output_dir={run}", "run.resume=never", f"seed={seed}",
                f"model.path={export_of(base)}", "model.tiny=null", "data.arithmetic=null",
                f"data.train_path={train}", f"data.eval_path={base}/data/eval.jsonl",
                f"monitor.eval_interval={eval_every}", *selector_overrides(selector),
                f"stages=[{{name: grpo, algorithm: {{name: grpo, lr: 3.0e-4, clip_eps: 0.2}}, "
                f"trainer: {{max_steps: {steps}}}}}]"], run + ".log")
    with open(os.path.join(run, "metrics", "eval.jsonl")) as f:
        return {row["step"]: row["accuracy"] for row in map(json.loads, f)}


def informative_share(run: str) -> float:
    """The share of the run's GRPO groups whose rewards are not all equal (the groups that give
    GRPO a gradient; a selector's lever), from the consumed shards."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    spread, total = 0, 0
    for shard in glob.glob(os.path.join(run, "buffer", "*.done")):
        groups = pq.read_table(shard, columns=["group_id", "reward"]).group_by("group_id").aggregate(
            [("reward", "min"), ("reward", "max")])
        spread += pc.sum(pc.greater(groups.column("reward_max"), groups.column("reward_min"))).as_py() or 0
        total += groups.num_rows
    return spread / max(total, 1)


def first_reaching(curve: dict[int, float], target: float) -> int | None:
    return next((step for step in sorted(curve) if curve[step] >= target - 1e-9), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--taskset", choices=["quickstart", "easy_heavy", "small", "noisy", "sparse", "sources"], default="quickstart")
    parser.add_argument("--selectors", nargs="+", default=["shuffle", "difficulty"],
                        help="names, or name:key=value,... with data.selector options")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps per run")
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS,
                        help="warm-up steps (fewer: a weaker start, most tasks never solved); default: the recipe's")
    parser.add_argument("--sft-rows", type=int, default=SFT_ROWS, help="warm-up rows a step; default: the recipe's")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=None, help="accuracy to reach (default: shuffle's final)")
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "compare_selectors"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    base = warm_up(args.out, args.sft_steps, args.sft_rows)
    train = taskset(args.out, base, args.taskset)
    curves = {(sel, seed): grpo(args.out, base, train, sel, seed, args.steps, args.eval_every)
              for sel in args.selectors for seed in args.seeds}
    finals = {key: curve[max(curve)] for key, curve in curves.items()}
    shuffle = [finals[(s, seed)] for s, seed in finals if s == "shuffle"]
    target = args.target if args.target is not None else (sum(shuffle) / len(shuffle) if shuffle else 0.9)
    steps = sorted({step for curve in curves.values() for step in curve})
    print(f"\nheld-out accuracy by GRPO step (target {target:.3f}: {'--target' if args.target else 'shuffle mean final'})")
    print("selector     seed " + " ".join(f"{s:>6}" for s in steps))
    result = {"taskset": args.taskset, "sft_steps": args.sft_steps, "sft_rows": args.sft_rows, "target": target, "runs": {}}
    for (sel, seed), curve in curves.items():
        print(f"{sel:<12} {seed:>4} " + " ".join(f"{curve.get(s, float('nan')):6.3f}" for s in steps))
        reached = first_reaching(curve, target)
        result["runs"][f"{sel}/{seed}"] = {
            "final": finals[(sel, seed)], "best": max(curve.values()), "reached_at": reached,
            "informative_groups": informative_share(run_dir(args.out, base, train, sel, seed))}
    for sel in args.selectors:
        runs = [result["runs"][f"{sel}/{seed}"] for seed in args.seeds]
        reached = [r["reached_at"] for r in runs]
        result[sel] = {"mean_final": sum(r["final"] for r in runs) / len(runs),
                       "mean_best": sum(r["best"] for r in runs) / len(runs),
                       "reached_target_at": reached,
                       "informative_groups": sum(r["informative_groups"] for r in runs) / len(runs)}
        print(f"{sel}: mean final {result[sel]['mean_final']:.3f}, reached target at GRPO steps {reached}, "
              f"groups with a reward spread {result[sel]['informative_groups']:.0%}")
    print(json.dumps(result))


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/compare_selectors.py")  # whatever main starts ends with it
