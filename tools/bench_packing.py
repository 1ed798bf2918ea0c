"""Train time per step, padded microbatches vs packed ones (trainer.max_tokens_per_microbatch).

    python tools/bench_packing.py [--model smollm2_135m|tiny|PATH] [--step grpo|dpo] [--rows 16]
        [--micro-batch 4] [--budget 1024] [--repeats 2] [--threads 0]

One Megatron trainer rank (gloo) takes GRPO steps on GSM8K-length rows: each row is a GSM8K train
question as the prompt and its reference solution as the response (lengths vary as real responses
do), rewards alternating within groups of 4. `--step dpo`: DPO steps on `--rows` / 2 pairs instead,
each a question with its solution chosen and the next question's solution rejected, against a
frozen reference copy (microbatches hold whole pairs). The same batch is trained padded
(`--micro-batch` rows per microbatch) and packed (`--budget` tokens per microbatch), each from the
same weights, one warm-up step then `--repeats` timed steps. Prints one row per setting; the last
line is one JSON object: seconds per step (median), real tokens per second, the share of padded
positions, microbatches per step, the speed-up, and the largest difference between the two
settings' first-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_weight_sync import resolve_model  # noqa: E402


def gsm8k_rows(tokenizer, n: int) -> tuple[list[list[int]], list[list[int]]]:
    gsm8k = os.environ.get("RFT_GSM8K_DIR") or os.path.join(os.path.dirname(REPO), "shared", "data", "gsm8k")
    path = os.path.join(gsm8k, "train.jsonl")
    if not os.path.exists(path):
        sys.exit(f"GSM8K not found at {path}; set RFT_GSM8K_DIR")
    prompts, responses = [], []
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    for row in rows:
        prompts.append(tokenizer(f"Question: {row['question']}\nAnswer:", add_special_tokens=False).input_ids)
        responses.append(tokenizer(" " + row["answer"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
    return prompts, responses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--step", choices=("grpo", "dpo"), default="grpo")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rft.config import AlgorithmConfig
    from rft.runtime.topology import free_port
    from rft.trainer.dpo_step import dpo_step
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.microbatches import microbatches, pair_microbatches
    from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    model_dir = resolve_model(args.model, tempfile.mkdtemp(prefix="bench_packing_"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = gsm8k_rows(tokenizer, args.rows)
    if args.step == "dpo":  # rows 2i (chosen) and 2i+1 (rejected) of pair i
        pairs = args.rows // 2
        prompts = [prompts[i] for i in range(pairs) for _ in (0, 1)]
        responses = [r for i in range(pairs) for r in (responses[i], responses[(i + 1) % pairs])]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    if args.step == "dpo":
        batch = StepBatch(prompt_ids=prompts, response_ids=responses)
        algo = AlgorithmConfig(policy_loss="dpo", lr=1e-7)
    else:
        batch = StepBatch(prompt_ids=prompts, response_ids=responses, rewards=[float(i % 2) for i in range(args.rows)],
                          old_logprobs=[[-1.0] * len(r) for r in responses], group_ids=[i // 4 for i in range(args.rows)])
        algo = AlgorithmConfig(lr=1e-7)
    hf = load_hf_state(model_dir)

    def step(model, optimizer, ref, micro: int, budget: int) -> float:
        if args.step == "dpo":
            return dpo_step(model, optimizer, ref, batch, algo, micro, tokenizer.eos_token_id, budget)["loss/dpo"]
        return train_step(model, optimizer, batch, algo, micro, tokenizer.eos_token_id,
                          max_tokens_per_microbatch=budget)["loss/policy"]

    def step_bins(micro: int, budget: int) -> list[list[int]]:
        """The rows of each microbatch, as the step makes them (DPO: whole pairs)."""
        if args.step == "grpo":
            return microbatches(list(range(len(lengths))), lengths, micro, budget)
        return pair_microbatches(list(range(len(lengths) // 2)), lengths, micro, budget)

    results = {}
    for name, micro, budget in (("padded", args.micro_batch, 0), ("packed", args.micro_batch, args.budget)):
        model, geo = build_gpt_model(model_dir)
        load_hf_weights(model, hf, geo)
        ref = None
        if args.step == "dpo":
            ref, _ = build_gpt_model(model_dir)
            load_hf_weights(ref, hf, geo)
        optimizer = build_optimizer(model, lr=algo.lr)
        bins = step_bins(micro, budget)
        positions = sum(len(b) * max(lengths[r] for r in b) if not budget else sum(lengths[r] for r in b)
                        for b in bins)
        times, first_loss = [], None
        for repeat in range(args.repeats + 1):
            start = time.perf_counter()
            loss = step(model, optimizer, ref, micro, budget)
            if repeat == 0:
                first_loss = loss
            else:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        results[name] = {"seconds": seconds, "tokens_per_s": sum(lengths) / seconds, "microbatches": len(bins),
                         "padding_share": 1 - sum(lengths) / positions, "first_loss": first_loss}
        print(f"{name:7s} {seconds:7.2f} s/step  {sum(lengths) / seconds:8.1f} tokens/s  {len(bins)} microbatches  "
              f"{100 * results[name]['padding_share']:.0f}% padding", flush=True)
    dist.destroy_process_group()
    print(json.dumps({
        "model": args.model, "step": args.step, "rows": args.rows, "tokens": sum(lengths), "longest": max(lengths),
        "micro_batch": args.micro_batch, "budget": args.budget, "threads": torch.get_num_threads(),
        "padded_seconds": results["padded"]["seconds"], "packed_seconds": results["packed"]["seconds"],
        "padded_tokens_per_s": results["padded"]["tokens_per_s"], "packed_tokens_per_s": results["packed"]["tokens_per_s"],
        "padding_share": results["padded"]["padding_share"], "padded_microbatches": results["padded"]["microbatches"],
        "packed_microbatches": results["packed"]["microbatches"],
        "speedup": results["padded"]["seconds"] / results["packed"]["seconds"],
        "loss_diff": abs(results["padded"]["first_loss"] - results["packed"]["first_loss"])}))


if __name__ == "__main__":
    main()
