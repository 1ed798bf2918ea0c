"""Seconds per GRPO step of rft against TRL's GRPOTrainer, on the same workload in the same run.

    python tools/bench_grpo_step.py [--model smollm2_135m|PATH] [--prompts 8] [--samples 4]
        [--max-new 64] [--reward exact_match|math_verify|partial] [--steps 6] [--lr 1e-6] [--bf16]
        [--no-trl | --no-rft] [--out DIR] [rft overrides ...]

The workload: an instruct model in fp32 (default SmolLM2-135M-Instruct, after
`python tools/prepare_smollm2.py`), `--prompts` "a+b=" prompts per step with `--samples` samples
each (the GRPO group), at most `--max-new` new tokens, a reward on the sum (`--reward`: rft's
`exact_match`, the first line is the sum, or `math_verify`, the final number in the response is,
or `partial`: partial credit, 1 - |first number - sum| / sum, floored at 0, so the samples of a
group differ and every row trains; TRL's run calls the same function); one step = generate +
reward + train + weight sync into the generator. `--bf16`: mixed precision on both sides, bf16
matmuls with fp32 master weights (rft: `model.dtype=bfloat16`, its trainer keeps fp32 masters
and vLLM generates in bf16; TRL: `bf16=True`, autocast over fp32 weights); on CPUs with AMX or
avx512_bf16 both run their matmuls there.

rft: the real launcher (`cluster=local`: one Megatron trainer rank and one vLLM rank, synchronous),
a GRPO stage of `--steps` steps (trailing arguments are further launcher overrides, e.g.
`sync.offset=1 trainer.threads=1`); each step's split into rollout (generation and reward), train,
sync (the trainer's send and vLLM's load), buffer I/O and other comes from the ranks' metrics, as in
tools/bench_quickstart.py, and so do the trainer's tokens/s, model TFLOP/s and MFU (`rft_mfu`: bf16
on a GPU rft knows the peak of). On a GPU node this is the GRPO job's truth: e.g.
`--model /path/to/Qwen2.5-0.5B-Instruct --no-trl --max-new 256 model.dtype=bfloat16
trainer.max_tokens_per_microbatch=16384` prints step, rollout, train and sync seconds, tokens/s and
MFU as JSON. TRL, when `import trl` works: `GRPOTrainer` with its default HF
generation (`use_vllm=False`) on the same prompts, group size, lengths, learning rate and loss
(token-mean, no KL), fp32 without gradient checkpointing (TRL 1.x defaults to bf16 and recompute),
every prompt of a step in one generation batch and one optimizer step, timed
per step by a trainer callback. TRL is not one of rft's dependencies; to compare, install it next
to rft: `pip install trl datasets`. The first step of each is left out (start-up); the medians are
compared. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_quickstart import print_splits, step_splits  # noqa: E402
from bench_weight_sync import resolve_model  # noqa: E402

from rft.runtime.storage import read_jsonl  # noqa: E402


def write_tasks(path: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    """`count` "a+b=" tasks as a jsonl taskset (question, answer)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def partial_sum(trajectory, task) -> float:
    """Partial credit for "a+b=": 1 - |first number of the response - a+b| / (a+b), at least 0."""
    return partial_credit(trajectory.response, task.answer)


def partial_credit(response: str, answer: str) -> float:
    import re

    found = re.search(r"-?\d+", response)
    if found is None:
        return 0.0
    return max(0.0, 1.0 - abs(int(found.group()) - int(answer)) / int(answer))


def rft_reward(name: str) -> str:
    """`algorithm.reward` for --reward (the ranks import this module: tools/ is put on PYTHONPATH)."""
    return "bench_grpo_step.partial_sum" if name == "partial" else name


def rft_steps(model_dir: str, tasks: str, args, out: str) -> list[tuple[int, dict[str, float]]]:
    """Run the GRPO stage through the launcher; each step's time split, from the ranks' metrics."""
    cmd = [sys.executable, "-m", "rft.launch", "cluster=local", "model=smollm2_135m", f"model.path={model_dir}",
           f"run.output_dir={out}", f"data.train_path={tasks}", "algorithm=grpo",
           f"algorithm.reward={rft_reward(args.reward)}", *(["model.dtype=bfloat16"] if args.bf16 else []),
           f"algorithm.group_size={args.samples}", f"algorithm.lr={args.lr}", "algorithm.kl_coef=0.0",
           f"rollout.tasks_per_step={args.prompts}", f"rollout.max_new_tokens={args.max_new}",
           f"trainer.max_steps={args.steps}", f"trainer.micro_batch_size={args.prompts * args.samples}",
           "monitor.eval_interval=0", "monitor.progress=false", *args.overrides]
    print("rft:", " ".join(cmd), flush=True)
    tools = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tools, os.environ.get("PYTHONPATH"))))}
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=env)
    rows = read_jsonl(os.path.join(out, "metrics", "trainer0.jsonl"))
    for key, what in (("response_length/mean", "response tokens per sample"), ("reward/mean", "mean reward"),
                      ("train/rows_skipped", "rows of advantage 0 not forwarded")):
        print(f"rft {what}, by step:", " ".join(f"{r[key]:.1f}" for r in rows if key in r), flush=True)
    return step_splits(out)


def trainer_perf(run_dir: str) -> dict[str, float]:
    """Medians over the GRPO steps after the first of trainer rank 0's throughput: tokens/s, model
    TFLOP/s and MFU (bf16 on a known GPU; rft/trainer/flops.py)."""
    rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics", "trainer0.jsonl")) if "perf/model_tflops" in r][1:]
    keys = ("perf/train_tokens_per_s", "perf/model_tflops", "perf/mfu")
    return {f"rft_{key.split('/')[1]}": statistics.median(r[key] for r in rows)
            for key in keys if rows and all(key in r for r in rows)}


def trl_steps(model_dir: str, tasks: list[dict[str, str]], args, out: str) -> list[float] | None:
    """Seconds per optimizer step of TRL's GRPOTrainer on the same workload (None: TRL not installed)."""
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.started = 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.started)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    from rft.explorer.rewards import first_line_matches, math_verify_answer

    score = {"exact_match": first_line_matches, "math_verify": math_verify_answer, "partial": partial_credit}[args.reward]

    def exact_sum(completions, answer, **_):  # rft's reward function on the same text
        return [score(c[0]["content"], a) for c, a in zip(completions, answer)]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"]}
                                 for t in tasks])
    batch = args.prompts * args.samples
    # fp32 (or, --bf16, bf16 autocast over fp32 weights) without recompute, as rft trains here:
    # TRL 1.x's GRPOConfig defaults to bf16 autocast and gradient checkpointing
    config = GRPOConfig(output_dir=out, use_cpu=True, per_device_train_batch_size=batch,
                        num_generations=args.samples, max_completion_length=args.max_new,
                        learning_rate=args.lr, beta=0.0, loss_type="dapo", max_steps=args.steps,
                        bf16=args.bf16, fp16=False, gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"},
                        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
    timer, lengths = StepTimer(), []
    trainer = GRPOTrainer(model=model_dir, reward_funcs=exact_sum, args=config, train_dataset=dataset,
                          callbacks=[timer])
    # on CPU, TRL's run was seen on one core (top: 100%) where rft's ranks use every core
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"TRL: {torch.get_num_threads()} torch threads", flush=True)
    trainer.train()
    print("trl response tokens per sample, by step:", " ".join(f"{n:.1f}" for n in lengths), flush=True)
    return timer.seconds


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's flags (issue 15's by default), shared with tools/bench_train_vs_hf.py."""
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reward", default="exact_match", choices=["exact_match", "math_verify", "partial"])
    parser.add_argument("--bf16", action="store_true", help="bf16 matmuls, fp32 master weights, on both sides")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--no-trl", action="store_true", help="time rft alone")
    parser.add_argument("--no-rft", action="store_true", help="time TRL alone")
    parser.add_argument("overrides", nargs="*", help="launcher overrides for rft's run, e.g. sync.offset=1")
    parser.add_argument("--out", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("--steps: at least 2 (the first step is left out)")
    out = args.out or tempfile.mkdtemp(prefix="rft-bench-grpo-")
    os.makedirs(out, exist_ok=True)
    model_dir = resolve_model(args.model, out)
    tasks_path = os.path.join(out, "tasks.jsonl")
    tasks = write_tasks(tasks_path, args.prompts * args.steps)

    result = {"model": args.model, "prompts": args.prompts, "samples": args.samples, "max_new": args.max_new,
              "reward": args.reward, "bf16": args.bf16}
    if not args.no_rft:
        splits = rft_steps(model_dir, tasks_path, args, os.path.join(out, "rft"))[1:]
        print_splits(splits, label="rft step", digits=2)
        rows = [row for _, row in splits]
        result.update({f"rft_{k}": statistics.median(row[k] for row in rows) for k in rows[0]})
        result.update(trainer_perf(os.path.join(out, "rft")))
    trl = None if args.no_trl else trl_steps(model_dir, tasks, args, os.path.join(out, "trl"))
    if trl is None and not args.no_trl:
        print("TRL is not importable here: `pip install trl datasets` next to rft to compare", flush=True)
    if trl is not None:
        print("trl steps (s):", " ".join(f"{s:.2f}" for s in trl), flush=True)
        result["trl_step_s"] = statistics.median(trl[1:])
    if trl is not None and not args.no_rft:
        result["rft_over_trl"] = result["rft_step_s"] / result["trl_step_s"]
        print(f"rft {result['rft_step_s']:.2f} s per step, TRL {result['trl_step_s']:.2f} s: "
              f"rft takes {result['rft_over_trl']:.2f}x TRL's time", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/bench_grpo_step.py")  # whatever main starts ends with it
