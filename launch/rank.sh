#!/usr/bin/env bash
# Run one rft rank inside an allocation, optionally inside the Apptainer image:
#   srun launch/rank.sh python -m submitit.core._submit <folder>
# RFT_CONTAINER=/path/rft.sif runs the command with `apptainer exec --nv`, binding RFT_BINDS
# (comma-separated, e.g. the parallel filesystem). Without it the command runs on the host.
set -euo pipefail
if [[ -n "${RFT_CONTAINER:-}" ]]; then
  exec apptainer exec --nv ${RFT_BINDS:+--bind "$RFT_BINDS"} "$RFT_CONTAINER" "$@"
fi
exec "$@"
