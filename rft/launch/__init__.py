"""The login node's side of rft: `python -m rft.launch` composes and checks a run, prints its
plan, submits it (submitit: local processes or one Slurm job / job array), follows it and reports
how it ended. Nothing here runs inside a rank."""
