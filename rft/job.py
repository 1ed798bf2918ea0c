"""What every task of a job runs: find its role from its rank, then run the trainer or explorer."""

from __future__ import annotations

import os
import traceback

from omegaconf import OmegaConf


def pid_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "pids", f"rank{rank}.pid")


def run_rank(config: dict, master_port: int) -> dict:
    """Entry point pickled by submitit; `config` is the resolved, validated config tree."""
    from rft.cluster import init_trainer_group, rank_info_from_env
    from rft.config import RFTConfig

    cfg: RFTConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RFTConfig), config))
    info = rank_info_from_env(cfg.cluster, master_port)
    os.makedirs(os.path.dirname(pid_path(cfg.run.output_dir, info.rank)), exist_ok=True)
    with open(pid_path(cfg.run.output_dir, info.rank), "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {info.rank}/{info.world_size}: {info.role} (role rank {info.role_rank})", flush=True)
    import torch

    threads = cfg.trainer.threads or max(1, (os.cpu_count() or 1))
    torch.set_num_threads(threads)
    try:
        if info.role == "trainer":
            from rft.trainer.trainer import run_trainer

            init_trainer_group(info, cfg.sync.timeout_s)
            return run_trainer(cfg, info)
        from rft.explorer.explorer import run_explorer

        return run_explorer(cfg, info)
    except BaseException:
        traceback.print_exc()
        raise
