"""Train tokens/s of rft's Megatron train step against HF transformers' forward + backward of the
same model on the same batch.

    python tools/bench_train_vs_hf.py [--model smollm2_135m|tiny|PATH] [--prompts 8] [--samples 4]
        [--max-new 64] [--micro-batch 32] [--budget 0] [--repeats 3] [--threads 0] [--profile]

The batch is a GRPO step's: `--prompts` "a+b=" prompts with `--samples` responses each, response
lengths spread over 8..`--max-new` tokens (token ids drawn at random: the cost of a step does not
depend on which tokens they are). rft: one Megatron trainer rank (gloo), `train_step` with the
GRPO preset (forward, logprobs and entropy, clipped loss, backward, AdamW), `--micro-batch` rows
per microbatch, or rows packed up to `--budget` tokens (trainer.max_tokens_per_microbatch). HF:
`AutoModelForCausalLM` (its default attention), the same rows right-padded in microbatches of
`--micro-batch` rows, log-softmax of the response tokens, token-mean loss, backward, AdamW. Both in fp32 from the same weights; one
warm-up step then `--repeats` timed steps each, taking turns; tokens/s counts real (unpadded)
tokens. rft is also timed with its logits at every position (`rft_every_position`), as before they
were restricted to the response targets.
`--profile` prints the ops rft's step spends its time in (torch.profiler, self CPU time).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_grpo_step import add_workload_args  # noqa: E402
from bench_weight_sync import resolve_model  # noqa: E402


def grpo_rows(tokenizer, prompts: int, samples: int, max_new: int, seed: int = 0):
    """(prompt ids, response ids) per row: `samples` rows per "a+b=" prompt."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompt_ids, response_ids = [], []
    for _ in range(prompts):
        prompt = tokenizer(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", add_special_tokens=False).input_ids
        for _ in range(samples):
            prompt_ids.append(prompt)
            response_ids.append([rng.randrange(vocab) for _ in range(rng.randint(8, max_new))])
    return prompt_ids, response_ids


def timed(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step function, after one warm-up call each. The steps take turns
    (a, b, a, b, ...): a shared machine's speed drifts by more than the differences measured."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def every_position(step):
    """`step` with the policy's logits at every position (as before they were restricted to the
    response targets): what that restriction saves."""
    from rft.trainer.pipeline import LogprobsHead

    def run():
        LogprobsHead.response_only = False
        try:
            return step()
        finally:
            LogprobsHead.response_only = True

    return run


def hf_step_fn(model_dir: str, prompts, responses, micro_batch: int, pad_id: int):
    """One HF training step on the rows: forward, response-token logprobs, token-mean loss, backward, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    tokens = sum(len(r) for r in responses)

    def step() -> None:
        optimizer.zero_grad()
        for start in range(0, len(prompts), micro_batch):
            rows = range(start, min(start + micro_batch, len(prompts)))
            width = max(len(prompts[i]) + len(responses[i]) for i in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
            attention = torch.zeros((len(rows), width), dtype=torch.int64)
            mask = torch.zeros((len(rows), width - 1))
            for row, i in enumerate(rows):
                p, r = prompts[i], responses[i]
                ids[row, : len(p) + len(r)] = torch.tensor(p + r)
                attention[row, : len(p) + len(r)] = 1
                mask[row, len(p) - 1: len(p) + len(r) - 1] = 1
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            logprobs = torch.gather(logits.log_softmax(-1), -1, ids[:, 1:, None]).squeeze(-1)
            (-(logprobs * mask).sum() / tokens).backward()
        optimizer.step()

    return step


def rft_step_fn(model_dir: str, prompts, responses, micro_batch: int, pad_id: int, budget: int = 0):
    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    samples = len(prompts) // len({tuple(p) for p in prompts}) or 1
    batch = StepBatch(prompt_ids=prompts, response_ids=responses,
                      rewards=[float(i % 2) for i in range(len(prompts))],
                      old_logprobs=[[-1.0] * len(r) for r in responses],
                      group_ids=[i // samples for i in range(len(prompts))])
    algo = AlgorithmConfig(lr=1e-7)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    optimizer = build_optimizer(model, lr=algo.lr)
    return lambda: train_step(model, optimizer, batch, algo, micro_batch, pad_id, max_tokens_per_microbatch=budget)


def profile(step, rows: int = 18) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--budget", type=int, default=0, help="rft: tokens per packed microbatch (0: padded)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rft.runtime.topology import free_port
    from rft.trainer.model import init_model_parallel

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    model_dir = resolve_model(args.model, tempfile.mkdtemp(prefix="bench_train_vs_hf_"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts, responses = grpo_rows(tokenizer, args.prompts, args.samples, args.max_new)
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    rft_step = rft_step_fn(model_dir, prompts, responses, args.micro_batch, pad_id, args.budget)
    steps = {"hf": hf_step_fn(model_dir, prompts, responses, args.micro_batch, pad_id), "rft": rft_step,
             "rft_every_position": every_position(rft_step)}
    seconds = timed(steps, args.repeats)
    for name, s in seconds.items():
        print(f"{name:18s} {s:7.2f} s/step  {tokens / s:8.1f} tokens/s", flush=True)
    if args.profile:
        profile(rft_step)
    dist.destroy_process_group()
    print(json.dumps({
        "model": args.model, "rows": len(prompts), "tokens": tokens, "micro_batch": args.micro_batch,
        "budget": args.budget, "threads": torch.get_num_threads(), "hf_seconds": seconds["hf"], "rft_seconds": seconds["rft"],
        "hf_tokens_per_s": tokens / seconds["hf"], "rft_tokens_per_s": tokens / seconds["rft"],
        "rft_every_position_seconds": seconds["rft_every_position"],
        "rft_over_hf": seconds["hf"] / seconds["rft"],
        "rft_every_position_over_hf": seconds["hf"] / seconds["rft_every_position"]}))


if __name__ == "__main__":
    main()
