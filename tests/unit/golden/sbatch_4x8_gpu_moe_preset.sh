#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=RUN/logs/%j_0_log.err
#SBATCH --gpus-per-node=8
#SBATCH --job-name=gsm8k_grpo
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=RUN/logs/%j_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output RUN/logs/%j_%t_log.out --error RUN/logs/%j_%t_log.err REPO/launch/rank.sh PYTHON -u -m submitit.core._submit RUN/logs
