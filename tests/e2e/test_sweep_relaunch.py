"""A sweep launched again with the same command resumes the runs that did not finish and leaves the
finished ones as they are, saying which is which (a single launch into a finished run is refused
instead: tests/e2e/test_first_contact.py)."""

import json
import os
import subprocess
import sys

from tests.e2e.helpers import REPO


def test_a_sweep_launched_again_resumes_its_unfinished_run_and_leaves_the_finished_one(tmp_path):
    sweep_dir = tmp_path / "sweep"
    command = [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "mode=train", "stages=[]",
               "algorithm=sft", "trainer.max_steps=4,8", "trainer.save_interval=2", f"hydra.sweep.dir={sweep_dir}",
               "monitor.progress=false", "monitor.plots=false"]
    # the second run's trainer is killed in its step 6, after its checkpoint at step 4; the first run
    # (4 steps) finishes before it
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "RFT_FAULTS": "kill_train@6#0"})
    assert first.returncode != 0, first.stdout[-3000:] + first.stderr[-3000:]
    finished = sweep_dir / "0" / "summary.json"
    assert finished.exists() and not (sweep_dir / "1" / "summary.json").exists(), first.stdout[-3000:]
    kept = finished.read_bytes()

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert f"rft: sweep run 0 -> {sweep_dir}/0: finished (its summary.json), left as it is" in said, said[-3000:]
    assert (f"rft: sweep run 1 -> {sweep_dir}/1: resume from {sweep_dir}/1/checkpoints/step00000004 "
            "(4 steps done)") in said, said[-3000:]
    assert finished.read_bytes() == kept  # not launched again
    assert json.loads((sweep_dir / "1" / "summary.json").read_text())["steps"] == 8
