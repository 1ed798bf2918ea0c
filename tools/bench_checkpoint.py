"""What a checkpoint costs the training loop: a synchronous save against a background one
(trainer.async_save, rft/runtime/background_save.py), on one Megatron trainer rank.

    python tools/bench_checkpoint.py [--model smollm2_135m|tiny|PATH|config.json] [--rows 8]
        [--prompt-len 64] [--response-len 64] [--baseline-steps 3] [--out DIR]

The trainer's sharded state (the model and its optimizer: what every checkpoint writes through
megatron-core's dist_checkpointing) is saved once synchronously (the loop waits for the files) and
once in the background (the loop waits for the plan and the copy to host memory, then trains on
while the rank's writer process writes; the checkpoint completes at the first step after the write),
twice: the first also lays out the shared memory the writer reads, the later one is what every
later save costs. The background save's stall is what the loop loses to it: the plan
and copy, the steps taken during the write beyond their usual time (the writer shares the
machine, at the lowest priority), and the completion (metadata). Target: a later save's stall at
most a fifth of the synchronous save. Step times are medians;
`--out` is where the checkpoints go (default a temporary directory: the run's filesystem is what a
user should measure). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_trainer import random_batch  # noqa: E402
from bench_weight_sync import resolve_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--baseline-steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="a directory on the filesystem to measure: the checkpoints go to a new directory in it, removed at the end (default: the temporary directory)")
    args = parser.parse_args()
    # its own directories, removed at the end: each run writes four checkpoints (6.5 GB for SmolLM2-135M)
    scratch = tempfile.mkdtemp(prefix="bench_checkpoint_")
    run_dir = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.out) if args.out else scratch
    try:
        measure(args, scratch, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: str, run_dir: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.runtime.checkpoint import finish_shards, save_shards, start_shards
    from rft.runtime.shard_writer import ShardWriter
    from rft.runtime.topology import free_port
    from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.sharded_state import ShardedModel
    from rft.trainer.train_step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    model_dir = resolve_model(args.model, scratch)
    model, geo = build_gpt_model(model_dir, "bfloat16" if on_gpu else "float32")
    load_hf_weights(model, load_hf_state(model_dir), geo)
    optimizer = build_optimizer(model, lr=1e-6)
    batch = random_batch(args.rows, args.prompt_len, args.response_len, geo.vocab_size)
    algo = AlgorithmConfig(lr=1e-6)

    def step() -> float:
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(model, optimizer, batch, algo, args.rows, 0)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def shards() -> dict:
        return {"model": ShardedModel(model).checkpoint_shards("model.", False),
                "optimizer": optimizer.checkpoint_shards("optimizer.", False)}

    # started with the trainer, as a run with trainer.async_save starts it, and ready before the steps are timed
    writer = ShardWriter()
    writer.ready(None)
    step()  # warm-up: allocations, and Adam's state exists from here on
    baseline = statistics.median(step() for _ in range(args.baseline_steps))
    print(f"step: {baseline:.2f} s (median of {args.baseline_steps})", flush=True)

    started = time.perf_counter()
    save_shards(run_dir, 1, shards())
    sync_s = time.perf_counter() - started
    nbytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(run_dir) for f in files)
    print(f"synchronous save: {sync_s:.2f} s for {nbytes / 1e9:.2f} GB", flush=True)

    def background(done: int) -> dict:
        started = time.perf_counter()
        pending = start_shards(run_dir, done, shards(), {}, writer)
        begin_s = time.perf_counter() - started
        during = []
        while pending.writing:  # the loop trains on; the write is done by a step's end
            during.append(step())
        written_s = time.perf_counter() - started
        started = time.perf_counter()
        finish_shards(pending)
        finish_s = time.perf_counter() - started
        slowdown_s = sum(max(0.0, s - baseline) for s in during)
        stall_s = begin_s + slowdown_s + finish_s
        print(f"background save {done - 1}: {begin_s:.2f} s to plan and copy, {len(during)} steps during the write "
              f"({statistics.median(during) if during else 0:.2f} s each, {slowdown_s:.2f} s beyond the usual), "
              f"{finish_s:.2f} s to complete; stall {stall_s:.2f} s = {stall_s / sync_s:.0%} of the synchronous save "
              f"({(begin_s + finish_s) / sync_s:.0%} without the steps' slowdown)", flush=True)
        return {"begin_s": begin_s, "steps_during_write": len(during),
                "step_during_write_s": statistics.median(during) if during else None, "slowdown_s": slowdown_s,
                "finish_s": finish_s, "written_after_s": written_s, "stall_s": stall_s,
                "stall_fraction": stall_s / sync_s, "stall_without_contention_s": begin_s + finish_s}

    # the first background save also lays out the writer's shared memory
    first, later = background(2), background(3)
    writer.close()
    dist.destroy_process_group()
    print(json.dumps({
        "model": args.model, "device": "cuda" if on_gpu else "cpu", "checkpoint_gb": nbytes / 1e9,
        "step_s": baseline, "sync_save_s": sync_s, "first_background": first, "later_background": later,
        "stall_fraction": later["stall_fraction"], "target_met": later["stall_s"] <= sync_s / 5}))


if __name__ == "__main__":
    main()
