"""The `cluster` section (ranks, Slurm request, container) and `sync` (how weights move from
trainer to rollout ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SyncConfig:
    interval: int = 1  # rollout stages: trainer steps between weight syncs (rft/runtime/schedule.py)
    offset: int = 0  # rollout stages: explorer steps ahead of the trainer (0: take turns, 1: one-step-off)
    free_run: bool = False  # rollout stages: the explorer never waits at the trainer's steps; it runs ahead within buffer.max_staleness (rft/runtime/free_run.py)
    decoupled: bool = False  # rollout stages: mode=explore and mode=train as two jobs on one run.output_dir, sharing only its buffer/ and weights/ (rft/runtime/decoupled.py)
    engine: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo | checkpoint
    bucket_mb: int = 512  # weight-transfer bucket size; two are in flight (double buffering)
    wire_dtype: str = "auto"  # dtype on the wire: auto (model.dtype, the engine's: vLLM samples from the weights trained) | a dtype (narrower: fewer bytes, vLLM samples from rounded weights)
    checkpoint_dir: Optional[str] = None  # checkpoint engine: where versions go (default: <run>/weights)
    timeout_s: float = 600.0  # a collective that takes longer fails, naming the peer
    start_timeout_s: float = 900.0  # opening a weight group (the first sync, after a restart or a lost engine) waits this long for every member: engines still starting (vLLM's start, a big model's load) or trainers still resuming; a member that died is named by the launcher sooner
    lora: str = "merged"  # LoRA stages: merged (W + B A, every weight) | adapter (A and B only, vLLM's LoRA)


@dataclass
class ClusterConfig:
    kind: str = "auto"  # auto (slurm if sbatch is on PATH and the controller answers) | local | slurm
    trainer_ranks: int = 1  # ranks [0, T) train
    rollout_ranks: int = 1  # ranks [T, T+R) generate
    judge_ranks: int = 0  # ranks [T+R, T+R+J) serve frozen judge engines (rft/explorer/judge.py; 0: none)
    colocate: bool = False  # rollout rank T+i shares trainer rank i's GPU; they take turns (rft/runtime/colocation.py)
    timeout_min: int = 240  # wall-clock limit of the job
    rank_server_idle_min: float = 10.0  # local CPU runs: ranks fork from a process that imported torch, megatron-core and vLLM once, kept this long after its last task (rft/runtime/rank_server.py); 0: a fresh interpreter per rank
    master_port: int = 0  # rendezvous port (0: local: a free one; slurm: derived from the job id)
    rendezvous_addr: Optional[str] = None  # slurm: where ranks reach rank 0 (None: the first node's Slurm NodeAddr)
    wait: bool = False  # slurm: follow the job to its end and exit with its status (local always waits)
    allocation: Optional[str] = None  # slurm: the id of a job whose allocation the ranks run in, as one step (srun), instead of a new job; cluster=auto sets it inside an allocation (a batch script, salloc's shell)
    partition: Optional[str] = None  # slurm partition (checked with sinfo before submit)
    account: Optional[str] = None  # slurm account to charge
    qos: Optional[str] = None  # slurm quality of service
    constraint: Optional[str] = None  # slurm node features, e.g. "a100&ib"
    nodes: int = 1  # nodes in the allocation
    gpus_per_node: Optional[int] = None  # GPUs per node, one task each; 0: CPU nodes; None: one per rank if sinfo lists GPUs (local: if this node shows GPUs)
    gpu_memory_gb: Optional[float] = None  # memory of each GPU, for the colocated-memory check before submit; None: nvidia-smi's on a local GPU run, else not checked
    devices: Optional[list[str]] = None  # local runs on a GPU node: the GPUs the ranks take, in rank order (CUDA_VISIBLE_DEVICES entries); None: those the launcher sees
    cpus_per_task: Optional[int] = None  # CPU cores per task; None: on GPU nodes the node's CPUs over its tasks (sinfo), 1 on CPU nodes and locally
    mem_gb: Optional[int] = None  # memory per node (None: the partition's default)
    setup: list[str] = field(default_factory=list)  # shell lines run before the ranks start (module load ...)
    sbatch_extra: dict[str, Any] = field(default_factory=dict)  # any other sbatch option, e.g. {reservation: x}
    container_image: Optional[str] = None  # Apptainer image the ranks run in (launch/rank.sh)
    container_binds: list[str] = field(default_factory=list)  # paths bound into the container
    env: dict[str, str] = field(default_factory=dict)  # exported for every rank, e.g. NCCL_IB_HCA
    max_requeues: int = 3  # times a job stopped by the time-limit signal requeues itself
    requeue: bool = True  # submit with --requeue, so that Slurm requeues a preempted job (which resumes from the checkpoint it saved on SIGTERM) and `scontrol requeue` works where a site sets JobRequeue=0; false: --no-requeue (a preempted or timed-out job then stops saved, and launching it again resumes)
    signal_delay_s: int = 120  # Slurm sends SIGUSR2 this long before the time limit: save, requeue
