"""Where the trainer's tensors for collectives live."""

from __future__ import annotations

import torch


def collective_device() -> torch.device:
    """Where tensors built for a collective must live: NCCL (GPU trainers) takes CUDA tensors only."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
