"""The GPUs a local run's ranks take (cluster=local on a GPU node, no Slurm): the launcher node's
visible GPUs, one per rank as on a Slurm node. Trainer rank i takes GPU i, an engine's leader its
tensor-parallel span, a judge its span; colocated, rollout rank T+i shares trainer rank i's GPU.

The launcher settles `cluster.gpus_per_node` and `cluster.devices` here, before the checks; each
rank then sees `cluster.devices` as CUDA_VISIBLE_DEVICES and picks its own by LOCAL_RANK
(rft/runtime/topology.py), as a Slurm task does among its node's GPUs. submitit's local executor
cannot do it: it gives every task the same devices, numbered 0..N-1 whatever the launcher's
CUDA_VISIBLE_DEVICES says (it ignores it), and "" with gpus_per_node=0.

Counting GPUs imports no torch (the launcher stays light): CUDA_VISIBLE_DEVICES where set, else
`nvidia-smi -L`, else the NVIDIA driver's /proc entries."""

from __future__ import annotations

import os
import shutil
import subprocess

from rft.config import RFTConfig, world_size
from rft.config.errors import config_error


def visible_gpus() -> list[str]:
    """This node's GPUs as CUDA_VISIBLE_DEVICES entries (indices, UUIDs or MIG names). CUDA reads
    CUDA_VISIBLE_DEVICES up to its first invalid entry: "" or "-1" hides every GPU."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = []
        for entry in (e.strip() for e in listed.split(",")):
            if not entry or entry.startswith("-"):
                break
            devices.append(entry)
        return devices
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            out = None
        if out is not None and out.returncode == 0:
            return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def gpu_memory_gb() -> float | None:
    """The smallest memory of this node's GPUs in GB, as nvidia-smi reports it (None without it)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        sizes = [float(line) * 2**20 / 1e9 for line in out.stdout.split()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return min(sizes) if sizes else None


def gpu_ranks(cfg: RFTConfig) -> int:
    """GPUs the layout takes: one per rank, or one per trainer rank when colocated."""
    return cfg.cluster.trainer_ranks if cfg.cluster.colocate and cfg.mode == "both" else world_size(cfg)


def resolve_local_gpus(cfg: RFTConfig) -> str | None:
    """Settle `cluster.gpus_per_node` (the GPUs the ranks take) and `cluster.devices` for a local
    run; refuse a layout that needs more GPUs than this node shows, naming the keys. Returns a line
    saying what was chosen, or None on a machine without GPUs."""
    c = cfg.cluster
    shown = list(c.devices) if c.devices is not None else visible_gpus()
    if c.gpus_per_node == 0 or not shown:
        if c.gpus_per_node:
            config_error("cluster.gpus_per_node", c.gpus_per_node,
                         "this machine shows no GPU (CUDA_VISIBLE_DEVICES, nvidia-smi): leave it unset or 0 to run "
                         "on CPU, or launch on a GPU node")
        if cfg.model.needs_gpu:
            config_error("model.needs_gpu", True, f"model {cfg.model.name} needs GPUs and "
                         f"{'cluster.gpus_per_node=0 gives the ranks none' if shown else 'this machine has none'} "
                         f"(cluster={c.kind}); run it on a GPU node or through Slurm (cluster=slurm), or pick a "
                         "smaller model, e.g. model=smollm2_135m")
        c.gpus_per_node, c.devices = 0, []
        return None
    need = gpu_ranks(cfg)
    layout = (f"cluster.trainer_ranks={c.trainer_ranks}, shared by the rollout ranks (cluster.colocate)"
              if need != world_size(cfg) else
              f"cluster.trainer_ranks={c.trainer_ranks} + cluster.rollout_ranks={c.rollout_ranks}"
              + (f" + cluster.judge_ranks={c.judge_ranks}" if c.judge_ranks else "")
              + f" in mode={cfg.mode}")
    if need > len(shown):
        config_error("cluster.gpus_per_node", c.gpus_per_node,
                     f"the ranks take one GPU each, {need} GPUs ({layout}), and this node shows {len(shown)} "
                     f"({','.join(shown)}): use fewer ranks (an engine of rollout.tensor_parallel_size=N takes N "
                     "rollout ranks), colocate the rollout ranks with the trainer's (cluster.colocate=true), or "
                     "run through Slurm on more nodes (cluster=slurm cluster.nodes=N)")
    if c.gpus_per_node is not None and c.gpus_per_node != need:
        config_error("cluster.gpus_per_node", c.gpus_per_node,
                     f"the ranks take one GPU each, {need} GPUs ({layout}): leave cluster.gpus_per_node unset "
                     "(the launcher counts them) or set it to that")
    c.gpus_per_node, c.devices = need, shown[:need]
    if c.gpu_memory_gb is None:
        c.gpu_memory_gb = gpu_memory_gb()
    return (f"cluster.gpus_per_node=auto -> {need}: GPUs {','.join(c.devices)} of the {len(shown)} this node "
            "shows, one per rank")


def rank_gpus(cfg: RFTConfig) -> list[tuple[int, str, list[str]]]:
    """(rank, role, its GPUs) for each rank of a local GPU run that takes GPUs of its own (an
    engine's followers and a colocated rollout rank use their leader's or trainer's), as the ranks
    pick them (rft/runtime/topology.py: LOCAL_RANK over cluster.devices)."""
    from rft.runtime.topology import Topology

    devices, gpus = cfg.cluster.devices or [], cfg.cluster.gpus_per_node or 0
    rows = []
    for rank in range(world_size(cfg)):
        member = Topology.of(cfg, rank)
        if member.is_engine_follower or member.is_judge_follower:
            continue
        local = rank % gpus if cfg.cluster.colocate else rank
        span = member.engine_span if member.role == "rollout" else member.judge_span if member.role == "judge" else 1
        rows.append((rank, member.role, devices[local:local + span]))
    return rows
