#!/bin/bash

# Parameters
#SBATCH --account=proj123
#SBATCH --constraint='a100&ib'
#SBATCH --cpus-per-task=8
#SBATCH --error=RUN/logs/%j_0_log.err
#SBATCH --gpus-per-node=8
#SBATCH --job-name=gsm8k
#SBATCH --mem=480GB
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=RUN/logs/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=normal
#SBATCH --requeue
#SBATCH --reservation=rl
#SBATCH --signal=USR2@120
#SBATCH --time=720
#SBATCH --wckey=submitit

# setup
module load cuda/12.4
export NCCL_IB_HCA=mlx5
export NCCL_SOCKET_IFNAME=ib0
export RFT_CONTAINER=RUN/rft.sif
export RFT_BINDS=/scratch,/datasets

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output RUN/logs/%j_%t_log.out --error RUN/logs/%j_%t_log.err REPO/launch/rank.sh python -u -m submitit.core._submit RUN/logs
