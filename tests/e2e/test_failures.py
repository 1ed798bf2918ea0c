"""Bad input as a user would hit it: the launcher stops before launch, or exits non-zero naming
the rank that died and its log, without hanging."""

import os
import time

import pytest

from tests.e2e.helpers import launch


def test_missing_model_path_stops_before_launch(tmp_path):
    result = launch("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={tmp_path}/absent",
                    f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2
    assert "model.path" in result.stderr and "prepare_smollm2" in result.stderr
    assert not os.path.exists(tmp_path / "run" / "logs"), "nothing may be submitted"


def test_missing_dataset_stops_before_launch(tmp_path):
    result = launch("+experiment=quickstart", "data.arithmetic=null", f"data.train_path={tmp_path}/no.jsonl",
                    f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2
    assert "data.train_path" in result.stderr and "no such file" in result.stderr


@pytest.mark.slow
def test_dead_rank_makes_launcher_exit_with_rank_and_log(tmp_path):
    # A taskset with no usable row passes the pre-launch checks (the file exists) but makes the
    # trainer rank raise once it reads it, while the rollout rank is starting vLLM: the launcher
    # must notice, stop the job, and say who died and where its log is.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1="}\nnot json\n')
    started = time.time()
    result = launch("+experiment=quickstart", f"run.output_dir={tmp_path}/run", "data.arithmetic=null",
                    f"data.train_path={bad}", f"data.eval_path={bad}", timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    out = result.stdout
    assert "rank 0 failed" in out and "has no valid rows" in out
    log = out.split("log: ")[1].split()[0]
    assert os.path.exists(log) and log.endswith("_0_log.err")
    assert time.time() - started < 300
