"""CHORD against SFT-then-GRPO over the same number of steps, on the quickstart (issue: Trinity-RFT's
algorithms; docs/guides/distillation.md#chord-sft-and-rl-in-one-loss).

    python tools/compare_chord.py                        # warm-up 150 steps, then 160 steps each arm
    python tools/compare_chord.py --seeds 0 1 2          # the docs' table
    python tools/compare_chord.py --seeds 0 1 --out /scratch/chord
    python tools/compare_chord.py --chord "chord_mu_peak=0.5 chord_mu_decay_steps=0"   # other CHORD options

Both arms start from one model: the quickstart's SFT warm-up (256 rows a step, its recipe) stopped
after --warmup steps, short of the step where the model learns carries, so that there is something
left for either arm to learn. Then, per seed:
- `sft_grpo`: SFT for --sft steps (the recipe's lr, 256 rows a step), then GRPO for --grpo steps;
- `chord`: one CHORD stage of --sft + --grpo steps: GRPO on the policy's samples plus SFT on
  --expert-rows of the taskset's answers a step, mu decaying (cosine) from --mu-peak to
  --mu-valley, the learning rate from the SFT stage's to the GRPO stage's (cosine; --lr-decay
  constant keeps the SFT stage's).
Held-out accuracy (the 200 eval tasks) every --eval-every steps. Last line: one JSON object with
both curves per seed and their means.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_LR, GRPO_LR = 3.0e-3, 3.0e-4  # the quickstart recipe's stages (conf/experiment/quickstart.yaml)
SFT_ROWS = 256
# Both arms warm the learning rate up over the first steps, as the recipe's SFT stage does: a fresh
# Adam state at the full 3e-3 overshoots (measured: the SFT loss went 0.95 -> 2.3 at step 2)
WARMUP = 20


def launch(overrides: list[str], log: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local",
                               "monitor.progress=false", "monitor.plots=false", *overrides], cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"compare_chord: a run failed; see {log}")


def warm_up(root: str, steps: int) -> str:
    """The recipe's SFT stage alone for `steps` steps, exported as an HF model (made once, then
    reused); the export's directory."""
    base = os.path.join(root, f"warmup{steps}")
    if not glob.glob(os.path.join(base, "checkpoints", "hf", "v*", "config.json")):
        print(f"SFT warm-up ({steps} steps) -> {base}", flush=True)
        launch([f"run.output_dir={base}", "run.resume=never", "trainer.save_hf=true", f"trainer.save_interval={steps}",
                "stages=[{name: sft, algorithm: {name: sft, policy_loss: sft, lr: %g, warmup_steps: 20}, "
                "trainer: {max_steps: %d, sft_batch_size: %d}}]" % (SFT_LR, steps, SFT_ROWS)], base + ".log")
    return max(glob.glob(os.path.join(base, "checkpoints", "hf", "v*")))


def arm_stages(arm: str, args: argparse.Namespace) -> str:
    if arm == "sft_grpo":
        return ("stages=[{name: sft, algorithm: {name: sft, policy_loss: sft, lr: %g, warmup_steps: %d}, "
                "trainer: {max_steps: %d, sft_batch_size: %d}}, "
                "{name: grpo, algorithm: {name: grpo, lr: %g, clip_eps: 0.2}, trainer: {max_steps: %d}}]"
                % (SFT_LR, WARMUP, args.sft, SFT_ROWS, GRPO_LR, args.grpo))
    steps = args.sft + args.grpo
    extra = "".join(f", {kv.split('=', 1)[0]}: {kv.split('=', 1)[1]}" for kv in args.chord.split())
    return ("stages=[{name: chord, algorithm: {name: chord, expert_rows: %d, chord_mu_peak: %g, chord_mu_valley: %g, "
            "chord_mu_decay_steps: %d, chord_phi: %s, lr: %g, warmup_steps: %d, lr_decay: %s, min_lr_ratio: %g%s}, "
            "trainer: {max_steps: %d}}]"
            % (args.expert_rows, args.mu_peak, args.mu_valley, steps, str(args.phi).lower(), SFT_LR, WARMUP, args.lr_decay,
               GRPO_LR / SFT_LR, extra, steps))


def run_arm(root: str, model: str, arm: str, seed: int, args: argparse.Namespace) -> dict[int, float]:
    """Held-out accuracy by step of the arm (0: the warm-up's model)."""
    run = os.path.join(root, f"{arm}{'-' + args.tag if args.tag and arm == 'chord' else ''}-seed{seed}")
    if not os.path.exists(os.path.join(run, "summary.json")):
        print(f"{arm} seed {seed} -> {run}", flush=True)
        data = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(model))), "data")  # the warm-up's
        launch([f"run.output_dir={run}", "run.resume=never", f"seed={seed}", "model.tiny=null", f"model.path={model}",
                # the warm-up's tasks, not generated again (with another seed they would be another split)
                "data.arithmetic=null", f"data.train_path={data}/train.jsonl", f"data.eval_path={data}/eval.jsonl",
                f"monitor.eval_interval={args.eval_every}", arm_stages(arm, args)], run + ".log")
    with open(os.path.join(run, "metrics", "eval.jsonl")) as f:
        return {row["step"]: row["accuracy"] for row in map(json.loads, f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "compare_chord"))
    parser.add_argument("--warmup", type=int, default=150, help="SFT steps before both arms")
    parser.add_argument("--sft", type=int, default=100, help="the sft_grpo arm's SFT steps")
    parser.add_argument("--grpo", type=int, default=60, help="the sft_grpo arm's GRPO steps")
    # the defaults: the setting that learned fastest of those measured (docs/guides/distillation.md):
    # as many demonstrations a step as the SFT arm's rows, and the SFT share kept at 0.3 or more
    parser.add_argument("--expert-rows", type=int, default=SFT_ROWS, help="CHORD: demonstrations per step")
    parser.add_argument("--mu-peak", type=float, default=0.9)
    parser.add_argument("--mu-valley", type=float, default=0.3)
    parser.add_argument("--phi", action=argparse.BooleanOptionalAction, default=False,
                        help="CHORD-phi token weights (default: plain NLL, as the SFT arm)")
    parser.add_argument("--lr-decay", default="cosine", choices=["constant", "cosine"],
                        help="CHORD's lr: constant at the SFT stage's, or cosine from it to the GRPO stage's")
    parser.add_argument("--tag", default="", help="names the CHORD runs (chord-<tag>-seed<k>) to compare settings")
    parser.add_argument("--chord", default="", help="more algorithm options for the CHORD stage: 'key=value ...'")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--eval-every", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = warm_up(args.out, args.warmup)
    curves = {arm: {seed: run_arm(args.out, model, arm, seed, args) for seed in args.seeds}
              for arm in ("sft_grpo", "chord")}
    steps = sorted(set.intersection(*(set(c) for arm in curves.values() for c in arm.values())))
    print(f"\nheld-out accuracy by step (from the {args.warmup}-step warm-up's model)")
    print("arm       seed  " + "".join(f"{s:>7d}" for s in steps))
    means = {}
    for arm, by_seed in curves.items():
        for seed, curve in by_seed.items():
            print(f"{arm:<9} {seed:>4}  " + "".join(f"{100 * curve[s]:6.1f}%" for s in steps))
        means[arm] = {s: sum(c[s] for c in by_seed.values()) / len(by_seed) for s in steps}
        print(f"{arm:<9} mean  " + "".join(f"{100 * means[arm][s]:6.1f}%" for s in steps))
    print(json.dumps({"warmup": args.warmup, "steps": steps, "means": means,
                      "curves": {arm: {str(seed): c for seed, c in by.items()} for arm, by in curves.items()}}))


if __name__ == "__main__":
    main()
