"""Ranks -> roles, and the process groups every rank creates in the same order.

Global ranks [0, T) are trainer ranks, [T, T+R) rollout ranks, [T+R, T+R+J) judge ranks (frozen
vLLM engines rewards ask: rft/explorer/judge.py). Each rank learns its role from
its rank (submitit launches one task per slot and has no heterogeneous jobs). Two groups exist:
  1. the trainer group: torch.distributed's default group over trainer ranks only (Megatron's
     parallel state lives on it); rollout ranks never join it, because vLLM owns the default
     group inside its own worker processes;
  2. the weight groups (rft/weights/engines.py): one per pipeline stage, joining that stage's
     sender with every rollout worker; their store listens on the port after the trainer group's.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rft.config import ClusterConfig, RFTConfig, sync_engine

if TYPE_CHECKING:
    from rft.weights.engines import SyncLayout


@dataclass(frozen=True)
class RankInfo:
    rank: int  # global rank in the job
    world_size: int  # trainer + rollout + judge ranks
    trainer_ranks: int
    rollout_ranks: int
    master_addr: str
    master_port: int  # trainer group; weight groups use master_port + 1, the control group + 2
    judge_ranks: int = 0

    @property
    def role(self) -> str:
        if self.rank < self.trainer_ranks:
            return "trainer"
        return "rollout" if self.rank < self.trainer_ranks + self.rollout_ranks else "judge"

    @property
    def role_rank(self) -> int:
        """Rank within its role (trainer rank i, rollout rank j, judge rank k)."""
        first = {"trainer": 0, "rollout": self.trainer_ranks, "judge": self.trainer_ranks + self.rollout_ranks}
        return self.rank - first[self.role]

    @property
    def weight_port(self) -> int:
        return self.master_port + 1


def free_port() -> int:
    """A port that is free now with its next two (trainer, weight and control groups)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for offset in (1, 2):
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError("could not find three consecutive free ports on 127.0.0.1")


def rank_info_from_env(cluster: ClusterConfig, master_port: int) -> RankInfo:
    """Read this task's global rank from submitit's environment (local executor or Slurm)."""
    import submitit

    env = submitit.JobEnvironment()
    world = cluster.trainer_ranks + cluster.rollout_ranks + cluster.judge_ranks
    if env.num_tasks != world:
        raise RuntimeError(f"job has {env.num_tasks} tasks but cluster.trainer_ranks + "
                           f"cluster.rollout_ranks + cluster.judge_ranks = {world}")
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))  # GPU choice on multi-GPU nodes
    if cluster.kind == "local":
        addr = "127.0.0.1"
    else:
        from rft.slurm import port_for_job

        # rank 0 runs on the first node of the allocation; every task derives the same port from
        # the job id (an array task has its own SLURM_JOB_ID)
        addr = env.hostnames[0]
        master_port = master_port or port_for_job(os.environ.get("SLURM_JOB_ID", "0"))
    return RankInfo(rank=env.global_rank, world_size=world, trainer_ranks=cluster.trainer_ranks,
                    rollout_ranks=cluster.rollout_ranks, master_addr=addr, master_port=master_port,
                    judge_ranks=cluster.judge_ranks)


def init_trainer_group(info: RankInfo, timeout_s: float) -> None:
    """torch.distributed default group over the trainer ranks (gloo on CPU, NCCL on GPU)."""
    import datetime

    import torch
    import torch.distributed as dist

    assert info.role == "trainer"
    os.environ["MASTER_ADDR"] = info.master_addr
    os.environ["MASTER_PORT"] = str(info.master_port)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", info.rank % torch.cuda.device_count())))
    dist.init_process_group(backend, rank=info.rank, world_size=info.trainer_ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))


def engine_span(cfg: RFTConfig) -> int:
    """Tasks one vLLM engine spans: on GPU nodes (one task per GPU) its TP size, so the engine's
    workers use the GPUs of the tasks after its leader; elsewhere 1 (vLLM starts its TP workers
    as processes of the one task)."""
    return cfg.rollout.tensor_parallel_size if cfg.cluster.gpus_per_node else 1


def engine_count(cfg: RFTConfig) -> int:
    """vLLM engines in the job: one per rollout group of `engine_span` tasks."""
    return cfg.cluster.rollout_ranks // engine_span(cfg)


def engine_index(cfg: RFTConfig, info: RankInfo) -> int:
    """Which engine a rollout rank belongs to (0 .. engine_count - 1)."""
    return info.role_rank // engine_span(cfg)


def engine_ranks(cfg: RFTConfig) -> list[list[int]]:
    """Every engine's global ranks (its leader first), in engine order, from the config alone."""
    first, span = 0 if cfg.mode in ("explore", "serve") else cfg.cluster.trainer_ranks, engine_span(cfg)
    return [list(range(first + e * span, first + (e + 1) * span)) for e in range(engine_count(cfg))]


def engine_leaders(cfg: RFTConfig, info: RankInfo) -> list[int]:
    """Global ranks that run an engine (and write experience shards), in engine order."""
    return voting_ranks(cfg, info.trainer_ranks, info.trainer_ranks + info.rollout_ranks)[info.trainer_ranks:]


def is_engine_follower(cfg: RFTConfig, info: RankInfo) -> bool:
    """A rollout task that only holds a GPU for the engine its group's first task runs."""
    return info.role == "rollout" and info.role_rank % engine_span(cfg) != 0


def voting_ranks(cfg: RFTConfig, trainer_ranks: int, end: int) -> list[int]:
    """Global ranks that run a loop, vote at each step and save checkpoint files: trainer ranks
    and engine leaders among the ranks before `end` (an engine's followers only hold GPUs; judge
    ranks, after the rollout ranks, keep no state and never vote)."""
    return list(range(trainer_ranks)) + list(range(trainer_ranks, end, engine_span(cfg)))


def control_members(cfg: RFTConfig, info: RankInfo) -> list[int]:
    return voting_ranks(cfg, info.trainer_ranks, info.trainer_ranks + info.rollout_ranks)


def member_name(cfg: RFTConfig, info: RankInfo, rank: int) -> str:
    """How errors name a voting rank: "trainer rank 0", "rollout rank 2 (engine 1)"."""
    if rank < info.trainer_ranks:
        return f"trainer rank {rank}"
    engine = (rank - info.trainer_ranks) // engine_span(cfg)
    return f"rollout rank {rank}" + (f" (engine {engine})" if engine_count(cfg) > 1 else "")


def losable_members(cfg: RFTConfig, info: RankInfo) -> frozenset[int]:
    """Voting ranks the run goes on without (rollout.on_engine_failure=continue: engine leaders)."""
    return frozenset(engine_leaders(cfg, info)) if cfg.rollout.on_engine_failure == "continue" else frozenset()


def is_judge_follower(cfg: RFTConfig, info: RankInfo) -> bool:
    """A judge task that only holds a GPU for the judge engine its group's first task runs."""
    from rft.config import judge_span

    return info.role == "judge" and info.role_rank % judge_span(cfg) != 0


def engine_devices(cfg: RFTConfig, span: int | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine leader on a GPU node: its own GPU and its followers'
    (LOCAL_RANK .. LOCAL_RANK + span - 1 of what the task sees; span: the rollout engine's by
    default, a judge engine's for judge ranks); check_request keeps an engine inside one node."""
    span, local = span or engine_span(cfg), int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(cfg.cluster.gpus_per_node)]
    return ",".join(devices[local:local + span])


def sync_layout(cfg: RFTConfig, info: RankInfo, on_gpu: bool, engines: list[int] | None = None) -> "SyncLayout":
    """Weight-sync membership, identical on every rank. `engines`: the engine leaders that take
    part (default: all; rollout.on_engine_failure=continue leaves lost ones out, and the groups
    without them get their own names).

    Megatron orders ranks tp fastest, then dp, then pp, so stage s's first rank (TP rank 0 of
    DP replica 0) is s x trainer_ranks / pp; it sends that stage. Each rollout rank contributes
    one receiver per vLLM TP worker.
    """
    from rft.weights.engines import SyncLayout

    per_stage = cfg.cluster.trainer_ranks // cfg.trainer.pipeline_parallel_size
    workers = cfg.rollout.tensor_parallel_size
    leaders = engine_leaders(cfg, info)
    engines = leaders if engines is None else engines
    receivers = [f"engine {e} (rollout rank {leader}) worker {w}"
                 for e, leader in enumerate(leaders) if leader in engines for w in range(workers)]
    lost = [str(leader) for leader in leaders if leader not in engines]
    return SyncLayout(
        engine=sync_engine(cfg.sync, on_gpu), host=info.master_addr, port=info.weight_port,
        sender_ranks=[s * per_stage for s in range(cfg.trainer.pipeline_parallel_size)],
        receiver_names=receivers, timeout_s=cfg.sync.timeout_s, bucket_bytes=cfg.sync.bucket_mb << 20,
        checkpoint_dir=cfg.sync.checkpoint_dir or os.path.join(cfg.run.output_dir, "weights"),
        groups=f"stage-without-{'-'.join(lost)}-" if lost else "stage")
