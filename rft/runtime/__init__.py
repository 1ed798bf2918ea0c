"""What runs inside every rank, whatever its role: the task entry (task.py: topology, role, the
supervised child), the job's topology and process groups (topology.py), stop votes, requeue and
the control store (preemption.py, membership.py), the step schedule and control points
(schedule.py, control.py), run checkpoints and rank state (checkpoint.py, state.py), monitoring
and the pulse (monitor.py, pulse.py), files written whole (storage.py), the run directory
(run_dir.py), injected faults (faults.py) and the comparison of two runs (equivalence.py).

The launcher (rft/launch/) imports from here only to read what the ranks write (progress,
summaries, checkpoints, pid files) and to lay out the same topology in its plan.
"""
