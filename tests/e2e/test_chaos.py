"""tools/chaos.py as a user runs it, with one fault of each kind a single rank meets: two trainer
ranks (TP 2) and a rollout rank; one rank SIGKILLed during a train step, a weight sync and a
checkpoint save, one SIGSTOPped (a hang) during a sync, and SIGTERM to every rank (a preemption or
scancel: every rank saves after its step and stops; on a real Slurm: tests/slurm/test_slurm_preemption.py).
(A rollout rank killed while it generates: tests/e2e/test_engines.py, tests/e2e/test_free_run.py and
the crashed node of tests/slurm/test_multinode.py; `python tools/chaos.py` runs every kind.) Every
faulted launch exits non-zero within a bound, naming the rank, its role and its log (a SIGTERM:
saying where it stopped); launching again resumes from the newest complete checkpoint; every
experience is trained exactly once, no step's metrics are missing, and the run ends bit for bit as
the uninterrupted one."""

import json
import subprocess
import sys

from tests.e2e.helpers import REPO

# In CI's selection (not `heavy`): about 1.5 min of launches since local ranks fork from the rank
# server (rft/runtime/rank_server.py), and the chaos run is what the resume claims rest on.

KILL_EXIT_S = 30  # a SIGKILLed rank: the launcher notices within seconds; the rest is tearing down
STOP_EXIT_S = 30 + 30  # a stopped rank: the others' sync.timeout_s (tools/chaos.py sets 30), then teardown


def test_chaos_run_of_single_rank_faults_loses_nothing_and_ends_as_if_never_hit(tmp_path):
    kinds = "kill_train,kill_sync,kill_save,stop_sync,term"
    out = subprocess.run([sys.executable, "tools/chaos.py", "--faults", "5", "--kinds", kinds, "--seed", "0",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["experience_lost"] == 0 and summary["experience_extra"] == 0 and summary["metric_gaps"] == 0
    assert summary["identical_to_uninterrupted"] is True
    assert sorted(summary["injected"]) == sorted(kinds.split(",")) and summary["recovered"] == 5
    records = summary["launch_records"]
    assert len(records) == 6 and records[-1]["rc"] == 0
    for faulted, relaunch in zip(records, records[1:]):
        (fault,) = faulted["faults"]
        assert faulted["rc"] != 0, faulted
        if fault.startswith("term@"):  # a preemption's or scancel's SIGTERM to every rank: all save, then stop
            assert "stopped on SIGTERM (a preemption or scancel) at step" in faulted["failure"], faulted
            assert faulted["failure"].startswith("job "), faulted  # said as a stop, not as a rank's failure
            # saved after the step in progress: no step done when the signal came is trained again
            assert faulted["acted_step"] < faulted["checkpoint_after"] == relaunch["resumed_from"], (faulted, relaunch)
            assert faulted["checkpoint_after"] >= faulted["reached"], faulted
            continue
        rank = int(fault.split("#")[1])
        role = "rollout" if rank == 2 else "trainer"
        # the rank is named first, with its role and its log, though its peers failed too
        assert faulted["failure"].startswith(f"rank {rank} failed: {role} rank {rank} "), faulted
        assert f"log: {tmp_path}/run/logs/" in faulted["failure"] and f"_{rank}_log.err" in faulted["failure"], faulted
        if fault.startswith("kill_"):
            assert f"{role} rank {rank} was killed by SIGKILL" in faulted["failure"], faulted
            assert faulted["seconds_to_exit"] <= KILL_EXIT_S, faulted
        else:  # a hang: the others time out waiting; the launcher names the one that went silent
            assert f"{role} rank {rank} stopped responding" in faulted["failure"], faulted
            assert faulted["seconds_to_exit"] <= STOP_EXIT_S, faulted
        assert relaunch["resumed_from"] == faulted["checkpoint_after"] > 0, (faulted, relaunch)
