#!/bin/bash
set -e
module load cuda/12.4
export NCCL_IB_HCA=mlx5
export SUBMITIT_EXECUTOR=slurm
exec srun --jobid=4242 --job-name=gsm8k-1 --nodes=2 --ntasks=16 --ntasks-per-node=8 --cpus-per-task=8 --gpus-per-node=8 --signal=USR2@120 --unbuffered --output RUN/logs/%j_%t_log.out --error RUN/logs/%j_%t_log.err REPO/launch/rank.sh PYTHON -u -m submitit.core._submit RUN/logs
