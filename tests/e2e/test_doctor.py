"""`python -m rft.doctor` on this CPU machine: the CPU half of its checks (gloo for NCCL, vLLM's CPU
build sleeping and waking at both levels, torch's AdamW for TE's FusedAdam) runs and passes, in one
table; a check that fails says what to do and the exit code says so."""

import subprocess
import sys

from rft.config import RFTConfig
from rft.doctor.checks import run_dir
from tests.e2e.helpers import REPO


def test_doctor_runs_its_cpu_half_and_prints_one_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rft.doctor", "+experiment=quickstart", f"run.output_dir={tmp_path}"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = " ".join(result.stdout.replace("│", " ").split())
    for row in ("versions pass", "devices pass", "collective pass gloo all-reduce between 2 processes",
                "vLLM start pass the quickstart's tiny model", "vLLM sleep level 1, wake pass greedy tokens the same",
                "vLLM sleep level 2, wake pass greedy tokens the same", "weight load pass",
                "optimizer state pass torch's AdamW", "run directory pass"):
        assert row in table, (row, table)
    assert table.endswith("every check passed")


def test_a_run_directory_that_cannot_be_written_fails_naming_the_key(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    cfg = RFTConfig()
    cfg.run.output_dir = str(blocked / "run")  # under a file: cannot be made
    check = run_dir(cfg)
    assert check.status == "fail" and "run.output_dir" in check.fix
