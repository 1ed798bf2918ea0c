"""Slurm on the launcher side: is there a cluster, is the request valid for it, and the executor.

The job itself is submitit's: one sbatch job with nodes x tasks_per_node tasks under srun, each
running `rft.runtime.task.run_rank`, which finds its role from its global rank (rft/runtime/topology.py).
Everything here runs on the login node before submitting and fails with the key to fix.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Allocation:
    """The Slurm job the launcher runs inside (a batch script, salloc's shell, `srun --pty`)."""

    job_id: str
    nodes: int
    on_its_node: bool  # the launcher runs on one of the job's nodes (salloc's shell usually does not)
    partition: str | None


def allocation_here() -> Allocation | None:
    """The Slurm job whose environment the launcher runs in (SLURM_JOB_ID), None outside one."""
    import socket

    job, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        return None
    hosts = (_run(["scontrol", "show", "hostnames", nodelist]) or nodelist).split()
    here = {socket.gethostname(), socket.gethostname().split(".")[0], os.environ.get("SLURMD_NODENAME", "")}
    return Allocation(job, int(os.environ.get("SLURM_JOB_NUM_NODES", len(hosts))), bool(here & set(hosts)),
                      os.environ.get("SLURM_JOB_PARTITION"))


def resolve_kind(cluster: ClusterConfig) -> tuple[str, str]:
    """(kind, why) for `cluster=auto`: local inside a one-node Slurm job on its node (its ranks run
    there, in its allocation, as a local run); inside any other allocation slurm, as a step of that
    allocation (`cluster.allocation`, rft/launch/steps.py) instead of a second job queued from inside
    the first; else slurm when a controller answers, else local. Explicit kinds pass through."""
    if cluster.kind != "auto":
        return cluster.kind, "set"
    inside = allocation_here()
    if inside is not None and inside.nodes == 1 and inside.on_its_node:
        return "local", f"inside Slurm job {inside.job_id}, on its node: the ranks run here, in its allocation"
    if slurm_answers():
        if inside is None:
            return "slurm", "a Slurm controller answers"
        cluster.allocation = cluster.allocation or inside.job_id
        cluster.partition = cluster.partition or inside.partition
        return "slurm", (f"inside Slurm job {inside.job_id} ({inside.nodes} node(s)): the ranks run as a step of its "
                         "allocation (srun), not as a new job")
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
    """Partition and GPU count against what `sinfo` reports; nodes, GPUs and CPUs against the
    allocation's when the ranks run as its step."""
    c = cfg.cluster
    partitions = _run(["sinfo", "-h", "-o", "%P"])
    if partitions is None:
        config_error("cluster.kind", "slurm", "no Slurm controller answers `sinfo`; use `cluster=local`")
    if c.allocation:  # a step takes nodes of the allocation, which has what it has
        has = _job_nodes(c.allocation)
        if c.nodes > has:
            config_error("cluster.nodes", c.nodes, f"Slurm job {c.allocation}, whose allocation the ranks run in, has "
                         f"{has} node(s); lower cluster.nodes, or leave cluster.allocation unset to submit a job")
    found = node_resources(c)  # refuses a partition sinfo does not list, naming the key
    name, most, cpus = found if found else (f"partition {c.partition or '(default)'}", 0, 0)
    if c.gpus_per_node and c.gpus_per_node > most:
        config_error("cluster.gpus_per_node", c.gpus_per_node, f"the nodes of {name} have at most {most} GPUs")
    if cpus and c.cpus_per_task and c.cpus_per_task * tasks_per_node(cfg) > cpus:
        config_error("cluster.cpus_per_task", c.cpus_per_task,
                     f"{tasks_per_node(cfg)} tasks per node x {c.cpus_per_task} CPUs is more than the {cpus} CPUs of "
                     f"the nodes of {name}; lower it, or leave it unset (the node's CPUs over its tasks)")


def node_resources(c: ClusterConfig) -> tuple[str, int, int] | None:
    """(what they are, GPUs per node, CPUs per node) of the nodes the ranks will run on: those of the
    allocation when the ranks run as its step (cluster.allocation), else the partition's most GPUs
    and fewest CPUs (sinfo), named "partition NAME"."""
    if c.allocation:
        return allocation_nodes(c.allocation)
    found = partition_nodes(c.partition)
    return None if found is None else (f"partition {found[0]}", found[1], found[2])


@functools.lru_cache(maxsize=None)
def _job_fields(job_id: str) -> dict[str, str]:
    """`scontrol -o show job`'s fields (empty where the controller does not know the job), asked once."""
    shown = _run(["scontrol", "-o", "show", "job", job_id])
    return dict(f.split("=", 1) for f in (shown or "").split() if "=" in f)


def _job_nodes(job_id: str) -> int:
    """The job's node count (NumNodes, "2" or a pending job's range "2-4": its least)."""
    return max(1, int(_job_fields(job_id).get("NumNodes", "1").split("-")[0]))


def allocation_nodes(job_id: str) -> tuple[str, int, int]:
    """("job N's allocation", GPUs per node, CPUs per node) from `scontrol show job` (its CPUs and
    gres/gpu over its nodes: an allocation of like nodes). A job that is not running has no
    allocation for a step: a config error naming cluster.allocation."""
    fields = _job_fields(job_id)
    if fields.get("JobState") != "RUNNING":
        config_error("cluster.allocation", job_id, f"Slurm job {job_id} is "
                     f"{fields.get('JobState', 'unknown to scontrol').lower()}: the ranks can run as a step only of "
                     "a running job's allocation; leave cluster.allocation unset to submit a job")
    nodes = _job_nodes(job_id)
    tres = dict(item.split("=", 1) for item in fields.get("TRES", "").split(",") if "=" in item)
    gpus = int(tres.get("gres/gpu", "0")) // nodes
    return f"job {job_id}'s allocation", gpus, int(fields.get("NumCPUs", "0")) // nodes


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
    found = node_resources(c)
    if found is None:
        config_error("cluster.gpus_per_node", None,
                     f"sinfo does not tell the GPUs of partition {c.partition or '(default)'}; set "
                     "cluster.gpus_per_node=N (0 for CPU nodes) and cluster.partition")
    name, most, _ = found
    if most == 0:
        if cfg.model.needs_gpu:
            config_error("cluster.gpus_per_node", None,
                         f"{needs} but the nodes of {name} have none (sinfo lists no gpu gres): pick a "
                         "GPU partition with cluster.partition=NAME, or set cluster.gpus_per_node=N where a "
                         "site's GPUs are not Slurm gres")
        c.gpus_per_node = 0
        return f"cluster.gpus_per_node=auto -> 0 ({name} has CPU nodes)"
    gpu_ranks = c.trainer_ranks if c.colocate else world_size(cfg)  # colocated: a rollout rank shares each GPU
    per_node = math.ceil(gpu_ranks / c.nodes)
    each, gpu_each = ("one per trainer rank, shared with a rollout rank", "one GPU per trainer rank, shared with "
                      "a rollout rank") if c.colocate else ("one per rank", "one GPU per rank")
    if per_node > most:
        config_error("cluster.gpus_per_node", None,
                     f"the {gpu_ranks} ranks on cluster.nodes={c.nodes} need {per_node} GPUs per node ({each}) "
                     f"but the nodes of {name} have {most}; raise cluster.nodes, or set "
                     "cluster.gpus_per_node and the ranks yourself")
    c.gpus_per_node = per_node
    return f"cluster.gpus_per_node=auto -> {per_node} ({gpu_each}; the nodes of {name} have {most})"


def resolve_cpus(cfg: RFTConfig) -> str | None:
    """Settle `cluster.cpus_per_task` when unset: on GPU nodes the node's CPUs over its tasks, so a
    vLLM engine, its tokenizer and reward processes are not confined to one core; on CPU nodes 1, so
    several small jobs share a node (test clusters). Returns a line saying what auto chose, or None."""
    c = cfg.cluster
    if c.cpus_per_task is not None:
        return None
    found = node_resources(c) if c.gpus_per_node else None
    if not found or found[2] < 1:
        c.cpus_per_task = 1
        return None
    name, _, cpus = found
    c.cpus_per_task = max(1, cpus // tasks_per_node(cfg))
    return (f"cluster.cpus_per_task=auto -> {c.cpus_per_task} (the nodes of {name} have {cpus} CPUs, "
            f"{tasks_per_node(cfg)} tasks per node)")


def _gpus_in_gres(gres: str) -> int:
    """'gpu:a100:8(S:0-1)' or 'gpu:8' -> 8; anything else -> 0."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def setup_lines(c: ClusterConfig) -> list[str]:
    lines = list(c.setup)
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in c.env.items()]
    if c.container_image:
        lines.append(f"export RFT_CONTAINER={shlex.quote(c.container_image)}")
        if c.container_binds:
            lines.append(f"export RFT_BINDS={shlex.quote(','.join(c.container_binds))}")
    return lines


def rank_python(c: ClusterConfig) -> str:
    """The command each task runs its rank with: launch/rank.sh, which enters the container when one
    is configured, then its python (inside the image its own, on the host the launcher's)."""
    python = "python" if c.container_image else shlex.quote(sys.executable)
    return f"{os.path.join(REPO, 'launch', 'rank.sh')} {python}"


def srun_args(cfg: RFTConfig) -> list[str]:
    """srun's options for the ranks' step, in a submitted job and in an allocation alike."""
    args = []
    if cfg.rollout.on_engine_failure == "continue":
        # a site's KillOnBadExit=1 would end every task when a lost engine's task exits non-zero,
        # and Slurm ends a job one of whose nodes fails unless told not to (--no-kill)
        args += ["--kill-on-bad-exit=0", "--no-kill"]
    if colocated_on_gpus(cfg):
        args.append(f"--distribution=plane={cfg.cluster.gpus_per_node}")
    return args


def make_executor(cfg: RFTConfig, folder: str):
    """submitit's Slurm executor for this request (one sbatch job)."""
    import submitit

    c = cfg.cluster
    executor = submitit.SlurmExecutor(folder=folder, python=rank_python(c))
    params: dict[str, Any] = dict(
        job_name=cfg.run.name, time=c.timeout_min, nodes=c.nodes, ntasks_per_node=tasks_per_node(cfg),
        cpus_per_task=c.cpus_per_task or 1, setup=setup_lines(c), signal_delay_s=c.signal_delay_s)
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(c, key):
            params[key] = getattr(c, key)
    if c.mem_gb:
        params["mem"] = f"{c.mem_gb}GB"
    # submitit writes a bare `--requeue` for True and skips False, so the refusal is spelled out
    extra = {"requeue" if c.requeue else "no-requeue": True, **c.sbatch_extra}
    if cfg.rollout.on_engine_failure == "continue":
        extra = {"no_kill": True, **extra}
    if srun_args(cfg):
        params["srun_args"] = srun_args(cfg)
    if extra:
        params["additional_parameters"] = extra
    executor.update_parameters(**params)
    return executor
