"""A rank's place in its job, computed once: `Topology` (roles, engines, who votes, the rendezvous),
and the process groups every rank creates from it in the same order.

Global ranks [0, T) are trainer ranks, [T, T+R) rollout ranks, [T+R, T+R+J) judge ranks (frozen
vLLM engines rewards ask: rft/explorer/judge.py). Each rank learns its role from its rank
(submitit launches one task per slot and has no heterogeneous jobs). Rollout ranks form engines
of `engine_span` tasks (a vLLM engine with TP on GPU nodes spans one task per GPU; its first task,
the leader, runs it and the others only hold their GPUs). Two groups exist:
  1. the trainer group: torch.distributed's default group over trainer ranks only (Megatron's
     parallel state lives on it); rollout ranks never join it, because vLLM owns the default
     group inside its own worker processes;
  2. the weight groups (rft/weights/engines.py, `sync_layout`): one per pipeline stage, joining
     that stage's sender with every rollout worker; their store listens on the port after the
     trainer group's.
The control store (votes, meetings) listens on the port after that.

The task entry (rft/runtime/task.py) builds the Topology from the config and the task's
environment and hands it to the role; nothing below it asks the whole config these questions again.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, replace

from rft.config import ClusterConfig, RFTConfig, context_length, judge_span
from rft.runtime.rendezvous import bind_gloo_towards, rendezvous_address


@dataclass(frozen=True)
class Topology:
    """What every rank of a job agrees on about its shape, and which part of it this rank is."""

    rank: int  # global rank in the job
    trainer_ranks: int  # ranks [0, T) train (0 in mode=explore|serve)
    rollout_ranks: int  # ranks [T, T+R) generate (0 in mode=train)
    master_addr: str  # where rank 0's stores listen (the first node of the allocation)
    master_port: int  # trainer group; weight groups use master_port + 1, the control store + 2
    judge_ranks: int = 0  # ranks [T+R, T+R+J) serve judge engines
    engine_span: int = 1  # tasks one rollout engine spans (its TP size on GPU nodes, else 1)
    judge_span: int = 1  # tasks one judge engine spans
    lose_engines: bool = False  # rollout.on_engine_failure=continue: the run goes on without a lost engine
    context_length: int = 0  # tokens of prompt + response every rank uses (rft.config.context_length)
    master_node: str = ""  # Slurm: the node rank 0 runs on (for messages); "" on cluster=local

    @classmethod
    def of(cls, cfg: RFTConfig, rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 0) -> Topology:
        """The topology of `cfg`'s job as its mode runs it (mode=train starts trainer ranks only,
        explore and serve rollout ranks only) for global rank `rank`."""
        c = cfg.cluster
        trainers = 0 if cfg.mode in ("explore", "serve") else c.trainer_ranks
        rollouts = 0 if cfg.mode == "train" else c.rollout_ranks
        judges = c.judge_ranks if cfg.mode in ("both", "explore") else 0
        return cls(rank=rank, trainer_ranks=trainers, rollout_ranks=rollouts, judge_ranks=judges,
                   master_addr=master_addr, master_port=master_port,
                   engine_span=cfg.rollout.tensor_parallel_size if c.gpus_per_node else 1,
                   judge_span=judge_span(cfg), lose_engines=cfg.rollout.on_engine_failure == "continue",
                   context_length=context_length(cfg.model))

    @classmethod
    def from_env(cls, cfg: RFTConfig, master_port: int) -> Topology:
        """This task's topology, its rank and rendezvous read from submitit's environment (local
        executor or Slurm)."""
        import submitit

        env = submitit.JobEnvironment()
        # GPU choice on multi-GPU nodes; colocated, local ranks g and g + gpus_per_node share GPU g
        # (rft/launch/slurm.py places them so)
        gpus = cfg.cluster.gpus_per_node if cfg.cluster.colocate else 0
        local_rank = str(env.local_rank % gpus if gpus else env.local_rank)
        if cfg.cluster.kind == "local" and cfg.cluster.devices:
            # submitit's local executor hides the launcher's GPUs from its tasks: each rank sees the
            # run's (rft/launch/local_gpus.py) and picks its own by LOCAL_RANK, as on a Slurm node
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(cfg.cluster.devices)
            os.environ["LOCAL_RANK"] = local_rank
        os.environ.setdefault("LOCAL_RANK", local_rank)
        topology = cls.of(cfg, env.global_rank, "127.0.0.1", master_port)
        if env.num_tasks != topology.world_size:
            raise RuntimeError(f"job has {env.num_tasks} tasks but this mode's trainer + rollout + judge ranks "
                               f"(cluster.trainer_ranks, cluster.rollout_ranks, cluster.judge_ranks) are "
                               f"{topology.world_size}")
        if cfg.cluster.kind == "local":
            return topology
        # rank 0 runs on the first node of the allocation, reached at its cluster address
        # (rft/runtime/rendezvous.py); every task derives the same port from the job id (an array
        # task has its own SLURM_JOB_ID)
        # a step's own nodes (srun sets them in every task): a step of an allocation
        # (rft/launch/steps.py) may run on some of its nodes, not from the first
        from submitit.slurm.slurm import _parse_node_list  # Slurm's host-list syntax, as submitit reads it

        step_nodes = os.environ.get("SLURM_STEP_NODELIST")
        first_node = _parse_node_list(step_nodes)[0] if step_nodes else env.hostnames[0]
        addr = rendezvous_address(first_node, cfg.cluster.rendezvous_addr)
        bind_gloo_towards(addr)
        return replace(topology, master_addr=addr, master_node=first_node,
                       master_port=master_port or port_for_job(os.environ.get("SLURM_JOB_ID", "0"), _step_id()))

    @property
    def world_size(self) -> int:
        return self.trainer_ranks + self.rollout_ranks + self.judge_ranks

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

    @property
    def control_port(self) -> int:
        """Rank 0's control store (rft/runtime/preemption.py)."""
        return self.master_port + 2

    @property
    def engine_count(self) -> int:
        """vLLM rollout engines in the job: one per group of `engine_span` rollout tasks."""
        return self.rollout_ranks // self.engine_span

    @property
    def engine_index(self) -> int:
        """Which engine this rollout rank belongs to (0 .. engine_count - 1)."""
        return self.role_rank // self.engine_span

    @property
    def judge_index(self) -> int:
        """Which judge engine this judge rank belongs to."""
        return self.role_rank // self.judge_span

    @property
    def engine_ranks(self) -> list[list[int]]:
        """Every engine's global ranks (its leader first), in engine order."""
        first, span = self.trainer_ranks, self.engine_span
        return [list(range(first + e * span, first + (e + 1) * span)) for e in range(self.engine_count)]

    @property
    def engine_leaders(self) -> list[int]:
        """Global ranks that run an engine (and write experience shards), in engine order."""
        return [ranks[0] for ranks in self.engine_ranks]

    @property
    def voting_ranks(self) -> list[int]:
        """Global ranks that run a loop, vote at each step and save checkpoint files: trainer ranks
        and engine leaders (an engine's followers only hold GPUs; judge ranks keep no state and
        never vote)."""
        return list(range(self.trainer_ranks)) + self.engine_leaders

    @property
    def losable_ranks(self) -> frozenset[int]:
        """Voting ranks the run goes on without (rollout.on_engine_failure=continue: engine leaders)."""
        return frozenset(self.engine_leaders) if self.lose_engines else frozenset()

    @property
    def is_engine_follower(self) -> bool:
        """A rollout task that only holds a GPU for the engine its group's first task runs."""
        return self.role == "rollout" and self.role_rank % self.engine_span != 0

    @property
    def is_judge_follower(self) -> bool:
        """A judge task that only holds a GPU for the judge engine its group's first task runs."""
        return self.role == "judge" and self.role_rank % self.judge_span != 0

    def member_name(self, rank: int) -> str:
        """How logs and errors name a rank: "trainer rank 0", "rollout rank 2 (engine 1)", "judge rank 3"."""
        if rank < self.trainer_ranks:
            return f"trainer rank {rank}"
        if rank >= self.trainer_ranks + self.rollout_ranks:
            return f"judge rank {rank}"
        engine = (rank - self.trainer_ranks) // self.engine_span
        return f"rollout rank {rank}" + (f" (engine {engine})" if self.engine_count > 1 else "")


def _outside_ephemeral_ports() -> tuple[int, int]:
    """A range of ports [start, stop) no outgoing connection takes: below the kernel's ephemeral
    range, or above it where there is no room below."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - 3 > 2048:
        return max(1024, low - 16384), low - 3
    return high + 1, 65533


def free_port() -> int:
    """A port that is free now with its next two (trainer, weight and control groups).

    Chosen below the kernel's ephemeral range (net.ipv4.ip_local_port_range), where no outgoing
    connection takes its local port: the weight group's store listens on the second port only at
    the first sync, seconds later, and a port from the ephemeral range could be taken meanwhile by
    any connection the ranks open (seen: EADDRINUSE in a test run)."""
    start, stop = _outside_ephemeral_ports()
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(start, stop)
        try:
            for offset in (0, 1, 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError("could not find three consecutive free ports on 127.0.0.1")


def _step_id() -> int:
    """This task's Slurm step (0 outside one, and for the batch or extern step)."""
    step = os.environ.get("SLURM_STEP_ID", "0")
    return int(step) if step.isdigit() else 0


def port_for_job(job_id: str, step: int = 0) -> int:
    """The rendezvous port every task of a Slurm job derives alike (the next two are the weight
    and control stores'): spread over 20000-31999 by job id, so jobs sharing a node rarely collide.
    Below Linux's default ephemeral range (32768-60999), where no outgoing connection takes its
    local port: the weight store binds its port only at the first sync, minutes after start, when
    vLLM, NCCL and the store clients hold many ephemeral ports (free_port's reason, for local runs).
    A fixed range, not each node's ip_local_port_range: every task must derive the same port. The
    step (rft/launch/steps.py: launches inside one allocation, two at once for decoupled jobs) moves
    it on; a submitted job's ranks are its step 0."""
    return 20000 + ((int(job_id) + step) % 4000) * 3


def init_trainer_group(topology: Topology, timeout_s: float) -> None:
    """torch.distributed default group over the trainer ranks (gloo on CPU, NCCL on GPU)."""
    import datetime

    import torch
    import torch.distributed as dist

    assert topology.role == "trainer"
    os.environ["MASTER_ADDR"] = topology.master_addr
    os.environ["MASTER_PORT"] = str(topology.master_port)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", topology.rank % torch.cuda.device_count())))
    dist.init_process_group(backend, rank=topology.rank, world_size=topology.trainer_ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))


def rank_devices(cluster: ClusterConfig, topology: Topology) -> str:
    """The GPUs this rank computes on ("" on CPU nodes, and for an engine's or a judge's followers,
    whose GPUs their leader's vLLM drives): a trainer rank its own, a leader its span's."""
    if not cluster.gpus_per_node or topology.is_engine_follower or topology.is_judge_follower:
        return ""
    span = {"rollout": topology.engine_span, "judge": topology.judge_span}.get(topology.role, 1)
    return engine_devices(cluster, span)


def engine_devices(cluster: ClusterConfig, span: int) -> str:
    """CUDA_VISIBLE_DEVICES for an engine leader on a GPU node: its own GPU and its followers'
    (LOCAL_RANK .. LOCAL_RANK + span - 1 of what the task sees; span: Topology.engine_span for a
    rollout engine, judge_span for a judge's); check_request keeps an engine inside one node."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(cluster.gpus_per_node)]
    return ",".join(devices[local:local + span])
