"""Slurm on the launcher side: is there a cluster, is the request valid for it, and the executor.

The job itself is submitit's: one sbatch job with nodes x tasks_per_node tasks under srun, each
running `rft.runtime.task.run_rank`, which finds its role from its global rank (rft/runtime/topology.py).
Everything here runs on the login node before submitting and fails with the key to fix.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any

from rft.config import ClusterConfig, RFTConfig, config_error, judge_span, world_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(cmd: list[str], timeout_s: float = 15) -> str | None:
    """stdout of a Slurm client command, or None if it is missing, fails or hangs."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def slurm_answers() -> bool:
    """sbatch is on PATH and the controller answers `sinfo`."""
    return shutil.which("sbatch") is not None and _run(["sinfo", "-h", "-o", "%P"]) is not None


def allocation_here() -> tuple[str, int] | None:
    """(job id, its node count) of the Slurm job this launcher runs inside, on one of the job's
    own nodes (a batch script, `srun --pty`); None elsewhere. salloc's shell has SLURM_JOB_ID too
    but usually runs on the login node, on none of the job's nodes."""
    import socket

    job, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        return None
    hosts = (_run(["scontrol", "show", "hostnames", nodelist]) or nodelist).split()
    here = {socket.gethostname(), socket.gethostname().split(".")[0], os.environ.get("SLURMD_NODENAME", "")}
    if not here & set(hosts):
        return None
    return job, int(os.environ.get("SLURM_JOB_NUM_NODES", len(hosts)))


def resolve_kind(cluster: ClusterConfig) -> tuple[str, str]:
    """(kind, why) for `cluster=auto`: local inside a one-node Slurm job (its ranks run on the
    job's node, in its allocation, instead of in a second job queued from inside the first), else
    slurm when a controller answers, else local. Explicit kinds pass through."""
    if cluster.kind != "auto":
        return cluster.kind, "set"
    inside = allocation_here()
    if inside is not None and inside[1] == 1:
        return "local", f"inside Slurm job {inside[0]}, on its node: the ranks run here, in its allocation"
    if slurm_answers():
        why = "a Slurm controller answers"
        if inside is not None:
            why += (f"; inside job {inside[0]} of {inside[1]} nodes the ranks still go to a new job: steps of an "
                    "allocation of several nodes are not supported yet")
        return "slurm", why
    return "local", "no Slurm controller answers"


def tasks_per_node(cfg: RFTConfig) -> int:
    """One task per GPU on GPU nodes (two when colocated: a trainer and a rollout rank share each);
    on CPU nodes the ranks split evenly over the nodes."""
    cluster = cfg.cluster
    if not cluster.gpus_per_node:
        return math.ceil(world_size(cfg) / cluster.nodes)
    return cluster.gpus_per_node * (2 if cluster.colocate else 1)


def colocated_on_gpus(cfg: RFTConfig) -> bool:
    """Trainer and rollout ranks share GPU nodes' GPUs (cluster.colocate): Slurm then places the
    tasks by planes of gpus_per_node (srun --distribution=plane), so that trainer rank i and
    rollout rank T+i land on the same node, as local ranks g and g + gpus_per_node (one GPU)."""
    return bool(cfg.cluster.colocate and cfg.cluster.gpus_per_node)


def node_of(cfg: RFTConfig, rank: int) -> int:
    """The allocation's node that runs global rank `rank`: Slurm's block placement in rank order,
    or planes of gpus_per_node round-robin over the nodes when colocated on GPUs."""
    if colocated_on_gpus(cfg):
        return (rank // cfg.cluster.gpus_per_node) % cfg.cluster.nodes
    return rank // tasks_per_node(cfg)


def check_request(cfg: RFTConfig) -> None:
    """What can be checked without the cluster: the task layout and the container image."""
    c = cfg.cluster
    world = world_size(cfg)
    if c.nodes < 1:
        config_error("cluster.nodes", c.nodes, "use 1 or more")
    if c.gpus_per_node and c.colocate and c.trainer_ranks != c.nodes * c.gpus_per_node:
        config_error("cluster.trainer_ranks", c.trainer_ranks, f"colocated, a trainer rank on every GPU: must equal "
                     f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node}")
    elif c.gpus_per_node and not c.colocate and world != c.nodes * c.gpus_per_node:
        config_error("cluster.trainer_ranks + cluster.rollout_ranks + cluster.judge_ranks", world,
              f"one rank per GPU: must equal cluster.nodes x cluster.gpus_per_node = "
              f"{c.nodes} x {c.gpus_per_node}")
    if not c.gpus_per_node and world % c.nodes:
        config_error("cluster.nodes", c.nodes, f"must divide the {world} ranks (CPU nodes: ranks split evenly)")
    span = cfg.rollout.tensor_parallel_size
    if c.gpus_per_node and (c.gpus_per_node % span or c.trainer_ranks % span):
        config_error("rollout.tensor_parallel_size", span,
                     f"a vLLM engine must sit on one node: it must divide cluster.gpus_per_node "
                     f"({c.gpus_per_node}) and cluster.trainer_ranks ({c.trainer_ranks})")
    judges_start = c.trainer_ranks + c.rollout_ranks  # judge engines follow the rollout ranks
    if c.judge_ranks and c.gpus_per_node and (c.gpus_per_node % judge_span(cfg) or judges_start % judge_span(cfg)):
        config_error("judge.tensor_parallel_size", cfg.judge.tensor_parallel_size,
                     f"a judge engine must sit on one node: it must divide cluster.gpus_per_node "
                     f"({c.gpus_per_node}) and the ranks before the judges ({judges_start})")
    if c.container_image and not os.path.exists(c.container_image):
        config_error("cluster.container_image", c.container_image,
              "no such file; build it with `apptainer build rft.sif containers/rft.def`")


def check_against_cluster(cfg: RFTConfig) -> None:
    """Partition and GPU count against what `sinfo` reports."""
    c = cfg.cluster
    partitions = _run(["sinfo", "-h", "-o", "%P"])
    if partitions is None:
        config_error("cluster.kind", "slurm", "no Slurm controller answers `sinfo`; use `cluster=local`")
    found = partition_nodes(c.partition)  # refuses a partition sinfo does not list, naming the key
    name, most, cpus = found if found else (c.partition or "(default)", 0, 0)
    if c.gpus_per_node and c.gpus_per_node > most:
        config_error("cluster.gpus_per_node", c.gpus_per_node, f"the nodes of partition {name} have at most {most} GPUs")
    if cpus and c.cpus_per_task and c.cpus_per_task * tasks_per_node(cfg) > cpus:
        config_error("cluster.cpus_per_task", c.cpus_per_task,
                     f"{tasks_per_node(cfg)} tasks per node x {c.cpus_per_task} CPUs is more than the {cpus} CPUs of "
                     f"the nodes of partition {name}; lower it, or leave it unset (the node's CPUs over its tasks)")


def partition_nodes(partition: str | None) -> tuple[str, int, int] | None:
    """(partition name, most GPUs a node of it has, fewest CPUs a node of it has) from `sinfo`; the
    default partition when `partition` is None. None when sinfo does not answer or there is no default
    partition; a partition sinfo does not list is a config error naming cluster.partition."""
    listing = _run(["sinfo", "-h", "-o", "%P|%G|%c"])
    if listing is None:
        return None
    gpus: dict[str, int] = {}
    cpus: dict[str, int] = {}
    default = None
    for line in listing.splitlines():
        name, gres, node_cpus = (line.strip().split("|") + ["", ""])[:3]
        if name.endswith("*"):
            name = default = name.rstrip("*")
        gpus[name] = max(gpus.get(name, 0), _gpus_in_gres(gres))
        if node_cpus.isdigit():
            cpus[name] = min(cpus.get(name, int(node_cpus)), int(node_cpus))
    if partition and partition not in gpus:
        config_error("cluster.partition", partition, f"not a partition here; sinfo lists {sorted(gpus)}")
    name = partition or default
    return (name, gpus[name], cpus.get(name, 1)) if name in gpus else None


def kill_delays_s(partition: str | None) -> tuple[int | None, int | None]:
    """(KillWait, GraceTime of the partition) in seconds: after a `scancel`'s SIGTERM Slurm sends SIGKILL
    KillWait later; a preempted job gets GraceTime before that cancel. None where scontrol does not
    say. (A QOS's GraceTime, which `sacctmgr show qos` lists, may replace the partition's.)"""
    config = _run(["scontrol", "show", "config"]) or ""
    kill_wait = re.search(r"^KillWait\s*=\s*(\d+)", config, re.MULTILINE)
    # `scontrol -o show partition`: one line per partition, the default one with Default=YES
    lines = (_run(["scontrol", "-o", "show", "partition"]) or "").splitlines()
    line = next((p for p in lines if (f"PartitionName={partition} " in p if partition else " Default=YES " in p)), "")
    grace = re.search(r"\bGraceTime=(\d+)", line)
    return (int(kill_wait.group(1)) if kill_wait else None), (int(grace.group(1)) if grace else None)


def resolve_gpus(cfg: RFTConfig) -> str | None:
    """Settle `cluster.gpus_per_node` before validation, and refuse to run a model that needs
    GPUs (`model.needs_gpu`) where the ranks get none. Unset (None) on Slurm: one GPU per rank when
    the partition's nodes have GPUs (sinfo), CPU nodes otherwise; locally: one per rank of the GPUs
    this node shows (rft/launch/local_gpus.py). Returns a line saying what auto chose, or None."""
    c = cfg.cluster
    if c.kind != "slurm":
        from rft.launch.local_gpus import resolve_local_gpus

        return resolve_local_gpus(cfg)
    needs = f"model {cfg.model.name} needs GPUs (model.needs_gpu=true)"
    if c.gpus_per_node is not None:
        if c.gpus_per_node == 0 and cfg.model.needs_gpu:
            config_error("cluster.gpus_per_node", 0, f"{needs}: ask for GPUs, e.g. cluster.gpus_per_node=8")
        return None
    found = partition_nodes(c.partition)
    if found is None:
        config_error("cluster.gpus_per_node", None,
                     f"sinfo does not tell the GPUs of partition {c.partition or '(default)'}; set "
                     "cluster.gpus_per_node=N (0 for CPU nodes) and cluster.partition")
    name, most, _ = found
    if most == 0:
        if cfg.model.needs_gpu:
            config_error("cluster.gpus_per_node", None,
                         f"{needs} but the nodes of partition {name} have none (sinfo lists no gpu gres): pick a "
                         "GPU partition with cluster.partition=NAME, or set cluster.gpus_per_node=N where a "
                         "site's GPUs are not Slurm gres")
        c.gpus_per_node = 0
        return f"cluster.gpus_per_node=auto -> 0 (partition {name} has CPU nodes)"
    gpu_ranks = c.trainer_ranks if c.colocate else world_size(cfg)  # colocated: a rollout rank shares each GPU
    per_node = math.ceil(gpu_ranks / c.nodes)
    each, gpu_each = ("one per trainer rank, shared with a rollout rank", "one GPU per trainer rank, shared with "
                      "a rollout rank") if c.colocate else ("one per rank", "one GPU per rank")
    if per_node > most:
        config_error("cluster.gpus_per_node", None,
                     f"the {gpu_ranks} ranks on cluster.nodes={c.nodes} need {per_node} GPUs per node ({each}) "
                     f"but the nodes of partition {name} have {most}; raise cluster.nodes, or set "
                     "cluster.gpus_per_node and the ranks yourself")
    c.gpus_per_node = per_node
    return f"cluster.gpus_per_node=auto -> {per_node} ({gpu_each}; partition {name}'s nodes have {most})"


def resolve_cpus(cfg: RFTConfig) -> str | None:
    """Settle `cluster.cpus_per_task` when unset: on GPU nodes the node's CPUs over its tasks, so a
    vLLM engine, its tokenizer and reward processes are not confined to one core; on CPU nodes 1, so
    several small jobs share a node (test clusters). Returns a line saying what auto chose, or None."""
    c = cfg.cluster
    if c.cpus_per_task is not None:
        return None
    found = partition_nodes(c.partition) if c.gpus_per_node else None
    if not found or found[2] < 1:
        c.cpus_per_task = 1
        return None
    name, _, cpus = found
    c.cpus_per_task = max(1, cpus // tasks_per_node(cfg))
    return (f"cluster.cpus_per_task=auto -> {c.cpus_per_task} (partition {name}'s nodes have {cpus} CPUs, "
            f"{tasks_per_node(cfg)} tasks per node)")


def _gpus_in_gres(gres: str) -> int:
    """'gpu:a100:8(S:0-1)' or 'gpu:8' -> 8; anything else -> 0."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _setup_lines(c: ClusterConfig) -> list[str]:
    lines = list(c.setup)
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in c.env.items()]
    if c.container_image:
        lines.append(f"export RFT_CONTAINER={shlex.quote(c.container_image)}")
        if c.container_binds:
            lines.append(f"export RFT_BINDS={shlex.quote(','.join(c.container_binds))}")
    return lines


def make_executor(cfg: RFTConfig, folder: str):
    """submitit's Slurm executor for this request; ranks start through launch/rank.sh, which
    enters the container when one is configured."""
    import submitit

    c = cfg.cluster
    # inside the image its own python runs; on the host, the launcher's
    python = "python" if c.container_image else shlex.quote(sys.executable)
    executor = submitit.SlurmExecutor(folder=folder, python=f"{os.path.join(REPO, 'launch', 'rank.sh')} {python}")
    params: dict[str, Any] = dict(
        job_name=cfg.run.name, time=c.timeout_min, nodes=c.nodes, ntasks_per_node=tasks_per_node(cfg),
        cpus_per_task=c.cpus_per_task or 1, setup=_setup_lines(c), signal_delay_s=c.signal_delay_s)
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            params[key] = getattr(c, key)
    if c.mem_gb:
        params["mem"] = f"{c.mem_gb}GB"
    # submitit writes a bare `--requeue` for True and skips False, so the refusal is spelled out
    extra, srun_args = {"requeue" if c.requeue else "no-requeue": True, **c.sbatch_extra}, []
    if cfg.rollout.on_engine_failure == "continue":
        # a site's KillOnBadExit=1 would end every task when a lost engine's task exits non-zero,
        # and Slurm ends a job one of whose nodes fails unless told not to (--no-kill)
        srun_args += ["--kill-on-bad-exit=0", "--no-kill"]
        extra = {"no_kill": True, **extra}
    if colocated_on_gpus(cfg):
        srun_args.append(f"--distribution=plane={c.gpus_per_node}")
    if srun_args:
        params["srun_args"] = srun_args
    if extra:
        params["additional_parameters"] = extra
    executor.update_parameters(**params)
    return executor
