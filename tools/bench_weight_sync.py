"""Trainer -> rollout weight sync: time, bandwidth against the raw bound, and logprob parity.

    python tools/bench_weight_sync.py --model {tiny,smollm2_135m,PATH} [--trainer-tp N]
        [--trainer-pp N] [--rollout-tp N] [--engines N] [--engine {gloo,nccl,checkpoint}]
        [--bucket-mb N] [--repeats N] [--dtype float32] [--wire-dtype auto]

Starts T = TP x PP Megatron trainer ranks (gloo default group; NCCL on GPUs) beside `--engines`
real vLLM engines in this process (each its own engine process, one weight receiver per TP
worker), exactly as a job's ranks do; every sync reaches all engines at once. The trainers take a few AdamW steps (so the
weights are not the checkpoint's), then publish through the run's own `WeightPublisher` `--repeats`
times. A sync is timed from the moment the trainers start (after a barrier, with the rollout
waiting) to the moment vLLM has loaded and re-processed the weights. The raw bound is the same
weight group broadcasting one uint8 tensor of the same total size (checkpoint engine: writing and
reading one file of that size). Every other sync is received and discarded instead of loaded
into vLLM: `wire_seconds` times export, packing and the wire alone (vLLM's CPU backend re-packs
every linear layer after an update, which dominates on CPU). Finally vLLM scores fixed sequences
and the trainer's last stage does too (the diff is the largest over the engines). PATH is an HF directory or a config.json (random weights are generated for it).

Prints one row per sync; the last line is one JSON object with `seconds` (median sync into
vLLM), `bytes`, `gbps`, `raw_gbps`, `max_abs_logprob_diff`, `wire_seconds`, `wire_gbps`, plus
the settings.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from rft.config import RFTConfig  # noqa: E402
from rft.runtime.topology import Topology  # noqa: E402
from rft.weights.engines import sync_layout  # noqa: E402

SEQUENCES = [[5, 6, 14, 7, 8, 17, 9, 10, 2, 11, 12, 13], [12, 13, 14, 20, 21, 17, 30, 31, 5, 6]]


def resolve_model(spec: str, scratch: str) -> str:
    """An HF directory for `tiny`, `smollm2_135m`, an HF directory, or a config.json."""
    if spec == "tiny":
        from rft.config import TinyModelConfig
        from rft.models.tiny import create_tiny_model

        return create_tiny_model(TinyModelConfig(), os.path.join(scratch, "tiny"), seed=0)
    if spec == "smollm2_135m":
        from rft.models.smollm2 import DEFAULT_DIR, is_prepared

        path = os.environ.get("RFT_SMOLLM2_DIR", DEFAULT_DIR)
        if not is_prepared(path):
            sys.exit(f"--model smollm2_135m: {path} is not prepared; run `python tools/prepare_smollm2.py`")
        return path
    if os.path.isfile(os.path.join(spec, "config.json")):
        return spec
    if os.path.isfile(spec) and spec.endswith(".json"):
        from transformers import AutoConfig, AutoModelForCausalLM

        from rft.models.tiny import build_char_tokenizer

        out = os.path.join(scratch, "random")
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(spec)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        build_char_tokenizer().save_pretrained(out)  # vLLM needs a tokenizer; ids are given directly
        return out
    sys.exit(f"--model {spec!r}: use tiny, smollm2_135m, an HF directory or a config.json")


def make_config(args, model_dir: str, run_dir: str) -> RFTConfig:
    cfg = RFTConfig()
    cfg.model.path, cfg.model.dtype, cfg.run.output_dir = model_dir, args.dtype, run_dir
    cfg.cluster.trainer_ranks = args.trainer_tp * args.trainer_pp
    cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size = args.trainer_tp, args.trainer_pp
    cfg.rollout.tensor_parallel_size = args.rollout_tp
    cfg.cluster.rollout_ranks = args.engines  # one rank per engine off GPU nodes (Topology.engine_span)
    cfg.sync.engine, cfg.sync.bucket_mb, cfg.sync.wire_dtype = args.engine, args.bucket_mb, args.wire_dtype
    cfg.sync.timeout_s = args.timeout_s
    return cfg


def rank_info(cfg: RFTConfig, rank: int, port: int) -> Topology:
    return Topology.of(cfg, rank, "127.0.0.1", port)


def _wait_file(path: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s}s")
        time.sleep(0.001)


def _wait_for_trainers(trainers: list, scratch: str, timeout_s: float) -> None:
    """Until every trainer rank built its model, or one died: a model the trainer refuses must
    stop the tool at once, not after the weight group's timeout (the engines, up first, would wait
    there for a sender that never comes)."""
    deadline = time.time() + timeout_s
    while not os.path.exists(os.path.join(scratch, "trainers_up")):
        _check_trainers(trainers)
        if time.time() > deadline:
            raise TimeoutError(f"the trainer ranks did not build their model within {timeout_s}s")
        time.sleep(0.05)


def _check_trainers(trainers: list) -> None:
    """Stop now if a trainer rank died (it printed why: a model the trainer refuses, say), instead
    of waiting out the weight group's timeout for a sender that will never come."""
    for rank, process in enumerate(trainers):
        if process.exitcode not in (None, 0):
            sys.exit(f"trainer rank {rank} exited with code {process.exitcode}; its error is above")


def trainer_rank(rank: int, world: int, cfg: RFTConfig, port: int, scratch: str, repeats: int,
                 train_steps: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.publisher import WeightPublisher
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    if torch.cuda.is_available():  # vLLM holds GPU 0; NCCL wants one GPU per rank
        torch.cuda.set_device((1 + rank) % torch.cuda.device_count())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world)
    init_model_parallel(cfg.trainer.tensor_parallel_size, cfg.seed, cfg.trainer.pipeline_parallel_size)
    model, geo = build_gpt_model(cfg.model.path, cfg.model.dtype)
    load_hf_weights(model, load_hf_state(cfg.model.path), geo)
    optimizer = build_optimizer(model, lr=1e-3)
    batch = StepBatch(prompt_ids=[s[:4] for s in SEQUENCES], response_ids=[s[4:] for s in SEQUENCES])
    for _ in range(train_steps):
        train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), micro_batch_size=1, pad_id=0)
    device = next(model.parameters()).device
    mb = pack_microbatch([s[:1] for s in SEQUENCES], [s[1:] for s in SEQUENCES], 0, device)
    logprobs = forward_logprobs_pipelined(model, [mb])
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"logprobs": logprobs[0].float().cpu(), "mask": mb.loss_mask.cpu()},
                   os.path.join(scratch, "trainer_logprobs.pt"))
    publisher = WeightPublisher(cfg, rank_info(cfg, rank, port + 10), geo)
    dist.barrier()
    if rank == 0:  # every trainer rank built its model: the engines may join the weight group
        open(os.path.join(scratch, "trainers_up"), "w").close()
    total = torch.zeros(1, dtype=torch.float64, device=device)  # payload bytes of one sync, all senders
    for k in range(repeats):
        if rank == 0:
            _wait_file(os.path.join(scratch, f"ready{k}"), cfg.sync.timeout_s)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(scratch, f"t0_{k}"), "w") as f:
                f.write(repr(time.time()))
        total[0] = publisher.publish(model, k + 1)
    dist.all_reduce(total)
    if rank == 0:
        with open(os.path.join(scratch, "bytes"), "w") as f:
            f.write(str(int(total.item())))
    if rank == 0 and cfg.sync.engine != "checkpoint":
        nbytes = int(open(os.path.join(scratch, "bytes")).read())
        _wait_file(os.path.join(scratch, "ready_raw"), cfg.sync.timeout_s)
        with open(os.path.join(scratch, "t0_raw"), "w") as f:
            f.write(repr(time.time()))
        group = publisher.sender.group
        group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device), "raw bandwidth probe")
    dist.barrier()
    dist.destroy_process_group()


def vllm_logprobs(engine) -> list[list[float]]:
    return engine.prompt_logprobs(SEQUENCES)


def raw_checkpoint_seconds(directory: str, nbytes: int) -> float:
    """Write then read one tensor of `nbytes` with safetensors: the filesystem bound."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "raw_probe.safetensors")
    start = time.perf_counter()
    save_file({"raw": torch.empty(nbytes, dtype=torch.uint8)}, path)
    load_file(path)
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2_135m, an HF directory or a config.json")
    parser.add_argument("--trainer-tp", type=int, default=1)
    parser.add_argument("--trainer-pp", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--engines", type=int, default=1, help="vLLM engines that receive every sync")
    parser.add_argument("--engine", choices=["gloo", "nccl", "checkpoint"], default=None,
                        help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="model dtype on both sides")
    parser.add_argument("--wire-dtype", default="auto")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args()
    args.engine = args.engine or ("nccl" if torch.cuda.is_available() else "gloo")
    if args.rollout_tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # see RolloutEngine

    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine
    from rft.runtime.topology import free_port

    scratch = tempfile.mkdtemp(prefix="rft-bench-sync-")
    model_dir = resolve_model(args.model, scratch)
    cfg = make_config(args, model_dir, os.path.join(scratch, "run"))
    world = cfg.cluster.trainer_ranks
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    # daemons: if this process fails (say vLLM cannot start), the trainer ranks go with it
    trainers = [ctx.Process(target=trainer_rank, args=(r, world, cfg, port, scratch, 2 * args.repeats, args.train_steps),
                            daemon=True) for r in range(world)]
    for p in trainers:
        p.start()
    engines = [RolloutEngine(ModelConfig(name=args.model, path=model_dir, dtype=args.dtype),
                             RolloutConfig(kv_cache_gb=args.kv_cache_gb, tensor_parallel_size=args.rollout_tp,
                                           gpu_memory_utilization=0.3 / args.engines),
                             seed=0, max_model_len=64, name=f"engine {e}") for e in range(args.engines)]
    before = vllm_logprobs(engines[0])
    _wait_for_trainers(trainers, scratch, args.timeout_s)
    layout = sync_layout(cfg, rank_info(cfg, world, port + 10), torch.cuda.is_available())
    for e, engine in enumerate(engines):
        engine.open_weight_receiver(layout, e * args.rollout_tp)
    pool = ThreadPoolExecutor(len(engines))  # a broadcast needs every receiver at once

    def on_every_engine(call):
        return [f.result() for f in [pool.submit(call, engine) for engine in engines]]

    seconds, wire_seconds = [], []
    print(f"{'sync':>5} {'into':>7} {'seconds':>9} {'tail_s':>8}", flush=True)
    for k in range(2 * args.repeats):
        # even syncs load into vLLM (the real path); odd ones are received and discarded,
        # which times export + packing + the wire alone
        into_vllm = k % 2 == 0 or args.engine == "checkpoint"
        _check_trainers(trainers)
        open(os.path.join(scratch, f"ready{k}"), "w").close()
        tail_s = max(on_every_engine(lambda engine: engine.receive_weights(apply=into_vllm)))
        done = time.time()
        _wait_file(os.path.join(scratch, f"t0_{k}"), 5)
        with open(os.path.join(scratch, f"t0_{k}")) as f:
            elapsed = done - float(f.read())
        (seconds if into_vllm else wire_seconds).append(elapsed)
        print(f"{k:>5} {'vllm' if into_vllm else 'wire':>7} {elapsed:>9.3f} {tail_s:>8.3f}", flush=True)
    _wait_file(os.path.join(scratch, "bytes"), args.timeout_s)
    nbytes = int(open(os.path.join(scratch, "bytes")).read())
    if args.engine == "checkpoint":
        raw_s = raw_checkpoint_seconds(cfg.run.output_dir, nbytes)
    else:
        open(os.path.join(scratch, "ready_raw"), "w").close()
        on_every_engine(lambda engine: engine.collective_rpc("rft_raw_broadcast", (nbytes,)))
        raw_s = time.time() - float(open(os.path.join(scratch, "t0_raw")).read())
    for p in trainers:
        p.join(timeout=args.timeout_s)
        if p.exitcode != 0:
            sys.exit(f"a trainer rank exited with {p.exitcode}")
    trained = torch.load(os.path.join(scratch, "trainer_logprobs.pt"))
    diff, after = 0.0, None
    for engine in engines:
        after = vllm_logprobs(engine)
        diff = max([diff] + [(torch.tensor(a) - trained["logprobs"][row, : len(a)]).abs().max().item()
                             for row, a in enumerate(after)])
    moved = max((torch.tensor(b) - torch.tensor(a)).abs().max().item() for b, a in zip(before, after))
    median = statistics.median(seconds)
    wire = statistics.median(wire_seconds) if wire_seconds else None
    result = {"seconds": round(median, 4), "bytes": nbytes, "gbps": round(nbytes / median / 1e9, 3),
              "raw_gbps": round(nbytes / raw_s / 1e9, 3), "max_abs_logprob_diff": diff,
              "wire_seconds": wire and round(wire, 4), "wire_gbps": wire and round(nbytes / wire / 1e9, 3),
              "logprob_shift_from_checkpoint": round(moved, 4), "model": args.model, "engine": args.engine,
              "trainer_tp": args.trainer_tp, "trainer_pp": args.trainer_pp, "rollout_tp": args.rollout_tp,
              "engines": args.engines,
              "bucket_mb": args.bucket_mb, "repeats": args.repeats,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    from rft.runtime.supervisor import run_tool

    run_tool(main, "tools/bench_weight_sync.py")  # whatever main starts ends with it
