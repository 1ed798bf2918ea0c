"""The checks `python -m rft.doctor` runs on this node, each returning a `Check`: what was tried,
pass / fail / skip, what was seen, and what to do. GPU-only parts (NCCL, vLLM's GPU sleep,
Transformer Engine) run where a GPU is; on CPU the same checks take the CPU path (gloo, vLLM's CPU
build, torch's AdamW) and say which they ran."""

from __future__ import annotations

import copy
import datetime
import importlib
import os
import platform
import tempfile
import time
from dataclasses import dataclass

from rft.config import RFTConfig


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip
    seen: str
    fix: str = ""


def versions() -> Check:
    """The libraries the ranks import, as installed here (a mismatch with the launcher's shows)."""
    found = []
    # by module, not distribution: vLLM's CPU build installs as another distribution than `vllm`
    for module in ("torch", "vllm", "megatron.core", "transformers", "transformer_engine"):
        try:
            found.append(f"{module} {getattr(importlib.import_module(module), '__version__', '?')}")
        except Exception as err:  # absent, or built for another torch: what the ranks would meet
            found.append(f"{module} does not import ({type(err).__name__})")
    import torch

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build of torch"
    return Check("versions", "pass", f"Python {platform.python_version()}; {'; '.join(found)}; {cuda}")


def devices(cfg: RFTConfig) -> Check:
    """The GPUs this node shows and which each rank of the run would take (rft/launch/local_gpus.py)."""
    import torch

    from rft.launch.local_gpus import rank_gpus, resolve_local_gpus, visible_gpus

    shown = visible_gpus()
    if not shown:
        return Check("devices", "pass", "no GPU shown (CUDA_VISIBLE_DEVICES, nvidia-smi): the ranks run on CPU")
    if not torch.cuda.is_available():
        return Check("devices", "fail", f"the node shows GPUs {','.join(shown)} but torch finds none "
                     f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})",
                     "check the driver (nvidia-smi) is new enough for this CUDA, and that torch is a CUDA build")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    local = copy.deepcopy(cfg)  # the run's layout on this node, as a local launch resolves it
    local.cluster.kind, local.cluster.gpus_per_node, local.cluster.devices = "local", None, None
    try:
        resolve_local_gpus(local)
    except ValueError as err:
        return Check("devices", "fail", f"{names}: {err}", "fewer ranks, or run through Slurm on more nodes")
    plan = "; ".join(f"rank {rank} ({role}) GPU {','.join(gpus)}" for rank, role, gpus in rank_gpus(local))
    return Check("devices", "pass", f"{names}; driver CUDA {torch.version.cuda}; {plan}")


def _all_reduce_rank(rank: int, world: int, port: int, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    value = torch.full((1024,), float(rank + 1), device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(value)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(float(value[0])))
    dist.destroy_process_group()


def collective() -> Check:
    """An all-reduce between two processes over the backend the trainer ranks use here."""
    import torch
    import torch.multiprocessing as mp

    from rft.runtime.topology import free_port

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    if torch.cuda.is_available() and backend == "gloo":
        note = " (one GPU: NCCL needs two to talk; gloo checked instead)"
    else:
        note = ""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sum")
        start = time.perf_counter()
        try:
            mp.start_processes(_all_reduce_rank, args=(2, free_port(), backend, out), nprocs=2, start_method="spawn")
            total = float(open(out).read())
        except Exception as err:  # a rank's failure, as torch.multiprocessing reports it
            return Check("collective", "fail", f"{backend} all-reduce between 2 processes: {str(err).strip()[-300:]}",
                         "NCCL: check NCCL_SOCKET_IFNAME / NCCL_IB_HCA (cluster.env) and NCCL_DEBUG=INFO's output")
    if total != 3.0:
        return Check("collective", "fail", f"{backend} all-reduce of 1 and 2 gave {total}", "report it: a broken backend")
    return Check("collective", "pass", f"{backend} all-reduce between 2 processes in {time.perf_counter() - start:.1f}s{note}")


def _model_dir(cfg: RFTConfig, tmp: str) -> str:
    """The run's model where it is on disk; the quickstart's tiny model (made here) otherwise."""
    if cfg.model.path and cfg.model.tiny is None and os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        return cfg.model.path
    from rft.config import TinyModelConfig
    from rft.models.tiny import create_tiny_model

    return create_tiny_model(cfg.model.tiny or TinyModelConfig(), os.path.join(tmp, "model"), cfg.seed)


def engine(cfg: RFTConfig) -> list[Check]:
    """vLLM generates greedily, sleeps at each level and wakes, loads the weights again, and gives
    the same tokens each time (on CPU its sleep frees nothing, but the calls run the same way)."""
    import dataclasses

    from vllm import SamplingParams

    from rft.explorer.vllm_engine import RolloutEngine

    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(cfg, tmp)
        model = dataclasses.replace(cfg.model, path=path, tiny=None)
        rollout = dataclasses.replace(cfg.rollout, tensor_parallel_size=1)
        start = time.perf_counter()
        try:
            vllm = RolloutEngine(model, rollout, seed=cfg.seed, max_model_len=64, sleep_mode=True)
        except Exception as err:
            return [Check("vLLM start", "fail", f"{type(err).__name__}: {str(err)[:300]}",
                          "check rollout.gpu_memory_utilization / kv_cache_gb and the vLLM build for this torch")]
        what = path if path == cfg.model.path else "the quickstart's tiny model"
        checks.append(Check("vLLM start", "pass", f"{what} in {time.perf_counter() - start:.1f}s"))
        prompt = vllm.tokenizer("1+1=")["input_ids"]

        def tokens() -> list[int]:
            params = SamplingParams(max_tokens=8, temperature=0.0, seed=0)
            return list(vllm.run(vllm.generate(prompt, params))[0].token_ids)

        try:
            first = tokens()
            for level in (1, 2):
                vllm.sleep(level)
                if level == 2:  # level 2 drops the weights: they come back with a weight load only
                    vllm.wake(["weights"])
                    vllm.load_hf_dir(path)
                vllm.wake()
                again = tokens()
                same = again == first
                checks.append(Check(f"vLLM sleep level {level}, wake", "pass" if same else "fail",
                                    f"greedy tokens {'the same' if same else f'{first} then {again}'} after "
                                    f"sleep({level}) and wake", "" if same else "report it: vLLM's sleep lost state"))
            vllm.load_hf_dir(path)
            same = tokens() == first
            checks.append(Check("weight load", "pass" if same else "fail", "the same weights loaded again: "
                                + ("the same tokens" if same else "other tokens"),
                                "" if same else "report it: a weight load changed the model"))
        finally:
            vllm.close()
    return checks


def optimizer_state() -> Check:
    """megatron-core's Adam (Transformer Engine's FusedAdam where TE imports) saves and loads its
    state before its first step (rft/trainer/optimizer_contract.py)."""
    import io

    import torch

    from rft.trainer.optimizer_contract import start_adam_state

    try:
        from transformer_engine.pytorch.optimizers import FusedAdam

        device, kind = "cuda", "Transformer Engine's FusedAdam"
    except Exception:  # absent, or built for another torch
        FusedAdam, device, kind = torch.optim.AdamW, "cpu", "torch's AdamW (Transformer Engine does not import)"
    if device == "cuda" and not torch.cuda.is_available():
        FusedAdam, device, kind = torch.optim.AdamW, "cpu", "torch's AdamW (no GPU)"
    model = torch.nn.Linear(8, 8).to(device)
    try:
        optimizer = FusedAdam(model.parameters(), lr=1e-3)
        start_adam_state(optimizer)
        saved = io.BytesIO()
        torch.save(optimizer.state_dict(), saved)
        saved.seek(0)
        twin = FusedAdam(model.parameters(), lr=1e-3)
        start_adam_state(twin)
        twin.state_dict()
        twin.load_state_dict(torch.load(saved, weights_only=False))
    except Exception as err:
        return Check("optimizer state", "fail", f"{kind}: {type(err).__name__}: {err}",
                     "report it: a checkpoint of this optimizer cannot be resumed")
    return Check("optimizer state", "pass", f"{kind}: saved and loaded before its first step")


def run_dir(cfg: RFTConfig) -> Check:
    """The run directory can be made and written here (on a cluster: a filesystem the nodes share,
    which the launcher checks per job)."""
    path = cfg.run.output_dir
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".doctor-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        return Check("run directory", "fail", f"{path}: {err}", "set run.output_dir to a writable shared filesystem")
    return Check("run directory", "pass", f"{path} is writable")
