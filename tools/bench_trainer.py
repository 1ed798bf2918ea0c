"""Trainer throughput: GRPO optimizer steps of one Megatron rank, tokens/s and model FLOPs utilisation.

    python tools/bench_trainer.py [--model tiny|smollm2_135m|PATH|tools/configs/qwen2_0.5b.json]
        [--dtype bfloat16] [--rows 64] [--prompt-len 128] [--response-len 384] [--budget 8192]
        [--micro-batch 8] [--steps 5] [--peak-tflops 989] [--recompute none] [--transformer-impl auto]
        [--logprob-chunk 2048]

The GPU path's truth (rft/trainer/optimizer.py, megatron_optimizer.py): on CUDA the step runs
megatron-core's DDP and optimizer with fp32 master weights, the model in `--dtype`; on CPU the
plain-torch equivalent. Rows are random token ids with response lengths drawn up to
`--response-len` (half to full, as sampled responses vary), packed up to `--budget` tokens per
microbatch (0: `--micro-batch` padded rows). A config.json stands for a model of that shape with
random weights (no download: tools/configs/qwen2_0.5b.json and qwen2_1.5b.json are Qwen2.5-0.5B's
and -1.5B's shapes; tools/gpu_truth.sh runs the settings the README reports). One warm-up
step, then `--steps` timed ones. MFU counts 6 x parameters x tokens per step (the dense matmuls;
attention is left out, so it understates long sequences) against `--peak-tflops` (H100 SXM and
H200 dense bf16: 989). `--logprob-chunk` is trainer.logprob_chunk (0: whole logits). Peak memory:
the GPU's allocator peak, or on CPU the process's peak resident size. Prints a row per step; the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_weight_sync import resolve_model  # noqa: E402


def random_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    from rft.trainer.step_batch import StepBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response_len // 2, response_len + 1, (rows,), generator=gen).tolist()
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    return StepBatch(prompt_ids=prompts, response_ids=responses, rewards=[float(i % 2) for i in range(rows)],
                     old_logprobs=[[-2.0] * n for n in lengths], group_ids=[i // 8 for i in range(rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=384)
    parser.add_argument("--budget", type=int, default=8192, help="tokens per packed microbatch (0: padded)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=989.0 if torch.cuda.is_available() else 0.0)
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"],
                        help="trainer.transformer_impl: auto = Transformer Engine where it imports on a GPU")
    parser.add_argument("--logprob-chunk", type=int, default=2048,
                        help="trainer.logprob_chunk: positions per chunk of the fused output layer (0: whole logits)")
    args = parser.parse_args()

    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.runtime.topology import free_port
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.layer_spec import resolve_transformer_impl
    from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.train_step import train_step

    on_gpu = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    model_dir = resolve_model(args.model, tempfile.mkdtemp(prefix="bench_trainer_"))
    layers = resolve_transformer_impl(args.transformer_impl, lora=False)
    model, geo = build_gpt_model(model_dir, args.dtype, recompute=args.recompute, transformer_impl=layers,
                                 logprob_chunk=args.logprob_chunk)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, lr=1e-6)
    batch = random_batch(args.rows, args.prompt_len, args.response_len, geo.vocab_size)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    algo = AlgorithmConfig(lr=1e-6)
    times = []
    for step in range(args.steps + 1):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = train_step(model, optimizer, batch, algo, args.micro_batch, 0, max_tokens_per_microbatch=args.budget)
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if step:  # the first step warms up (allocations, kernels)
            times.append(seconds)
        print(f"step {step}{' (warm-up)' if not step else ''}: {seconds:.2f} s, {tokens / seconds:.0f} tokens/s, "
              f"loss {metrics['loss/policy']:.4f}, skipped {metrics['actor/step_skipped']:.0f}", flush=True)
    step_s = statistics.median(times)
    tflops = 6 * params * tokens / step_s / 1e12
    dist.destroy_process_group()
    print(json.dumps({
        "model": args.model, "params": params, "dtype": args.dtype, "device": "cuda" if on_gpu else "cpu",
        "optimizer": type(optimizer).__name__, "rows": args.rows, "tokens_per_step": tokens, "budget": args.budget,
        "recompute": args.recompute, "layers": layers, "logprob_chunk": args.logprob_chunk, "step_s": step_s, "tokens_per_s": tokens / step_s,
        "model_tflops": tflops,
        "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


if __name__ == "__main__":
    main()
