"""Start trainer ranks for a test in processes of their own (Megatron's parallel state is global, so
it stays out of pytest's process), and end them as a job's ranks end (rft/runtime/supervisor.py): with
os._exit once the worker returned. A normal interpreter exit after a gloo group tears down gloo's
C++ threads racily: about 1 run in 12 aborted with "terminate called without an active exception"
(SIGABRT) after the worker had finished and saved its results.

The ranks see no GPU unless a test asks for one (`gpu=True`, tests marked `gpu`): the trainer picks
its CUDA path (NCCL, megatron-core's optimizer) whenever CUDA is there, and the other tests are
tests of the CPU path, which must hold on a GPU machine too."""

import multiprocessing
import os
import sys
from unittest import mock

import torch.multiprocessing as mp

# CPU ranks start from a fork server that imported the trainer's stack once (torch, megatron-core,
# transformers: about 6 s per rank on 2 cores, most of a small test's time), not from a fresh
# interpreter each. The server imports modules only: every rank still builds its own Megatron
# state. It starts at the first CPU test, with CUDA hidden, so its ranks never see a GPU.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
                                        "transformers", "rft.trainer.model", "rft.trainer.train_step",
                                        "rft.trainer.hf_weights", "rft.trainer.optimizer"])


def start_ranks(worker, nprocs: int, *args, gpu: bool = False) -> None:
    """Run `worker(rank, *args)` on ranks 0..nprocs-1; raises if one fails."""
    # in the environment the ranks start with, so CUDA is hidden before any import asks for it; a
    # GPU test's ranks are spawned afresh (the fork server's environment hides the GPU)
    with mock.patch.dict(os.environ, {} if gpu else {"CUDA_VISIBLE_DEVICES": ""}):
        mp.start_processes(_run_then_exit, args=(worker, *args), nprocs=nprocs,
                           start_method="spawn" if gpu else "forkserver", join=True)


def _run_then_exit(rank: int, worker, *args) -> None:
    worker(rank, *args)  # an exception leaves through torch's wrapper, which reports it to the parent
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips multiprocessing's atexit, which ends the rank's own children: megatron-core's
    # checkpoint writer starts a Manager process, and it outlived the test (a job's ranks have
    # rft/runtime/supervisor.py end their process group instead)
    for child in multiprocessing.active_children():
        child.terminate()
    os._exit(0)
