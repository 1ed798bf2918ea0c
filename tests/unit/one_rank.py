"""One Megatron trainer rank on a group of one (gloo; NCCL on a GPU), in a spawned process: Megatron's parallel state
is global, so it stays out of pytest's process (tests/ranks.py). A worker is `worker(rank, port, model_dir, out)`,
starts with `init_one_rank(port)` and saves its results to `out` (further arguments after those)."""

import os

import torch

from rft.runtime.topology import free_port
from tests.ranks import start_ranks


def init_one_rank(port: int) -> None:
    import torch.distributed as dist

    from rft.trainer.model import init_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # as a job's trainer ranks (rft/runtime/topology.py): NCCL where the model lives on a GPU
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)


def run_one_rank(worker, tmp_dir: str, *args, gpu: bool = False) -> dict:
    """Run `worker` on one spawned rank (on the CPU path unless `gpu`) with the tiny model (default
    shape, seed 0) written to `tmp_dir`/model, and `args` after its own; what it saved."""
    from rft.config import TinyModelConfig
    from rft.models.tiny import create_tiny_model

    model_dir = create_tiny_model(TinyModelConfig(), os.path.join(tmp_dir, "model"), seed=0)
    out = os.path.join(tmp_dir, "out.pt")
    start_ranks(worker, 1, free_port(), model_dir, out, *args, gpu=gpu)
    return torch.load(out)
