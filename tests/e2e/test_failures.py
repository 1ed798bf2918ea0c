"""Bad input as a user would hit it: the launcher stops before launch, or exits non-zero naming
the rank that died and its log, without hanging."""

import os
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import REPO, launch


def test_missing_model_path_stops_before_launch(tmp_path):
    result = launch("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={tmp_path}/absent",
                    f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2
    assert "model.path" in result.stderr and "prepare_smollm2" in result.stderr
    assert not os.path.exists(tmp_path / "run" / "logs"), "nothing may be submitted"


def test_unset_model_path_names_the_key_and_the_line_to_add(tmp_path):
    """The headline command without model.path (the recipe's model has no default location)."""
    env = {k: v for k, v in os.environ.items() if k != "RFT_QWEN2_5_1_5B_DIR"}
    result = subprocess.run([sys.executable, "-m", "rft.launch", "+experiment=gsm8k_grpo", "cluster=local",
                             f"run.output_dir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2
    assert "model.path must be set (HF model directory" in result.stderr
    assert "python -m rft.launch +experiment=gsm8k_grpo cluster=local" in result.stderr
    assert "model.path=/path/to/hf_model" in result.stderr and "prepare_smollm2" in result.stderr
    assert "Traceback" not in result.stderr and "MissingMandatoryValue" not in result.stderr
    assert "HYDRA_FULL_ERROR" not in result.stderr
    assert set(os.listdir(tmp_path / "run")) <= {"hydra"}, "nothing but Hydra's own log may be written"


def test_gpu_model_refused_where_there_is_no_gpu(tmp_path, gsm8k_dir):
    """Qwen2.5-1.5B (model.needs_gpu) on this CPU machine: refused before anything starts."""
    smollm2 = os.path.expanduser("~/.cache/rft/models/smollm2-135m-instruct")
    result = launch("+experiment=gsm8k_grpo", f"model.path={smollm2}", f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2
    assert "model.needs_gpu=True" in result.stderr and "needs GPUs" in result.stderr
    assert "model=smollm2_135m" in result.stderr
    assert set(os.listdir(tmp_path / "run")) <= {"hydra"}


@pytest.mark.parametrize("experiment, override, section", [
    ("quickstart", "data.from_env.num_train=3", "from_env: {num_train: 3}"),  # null in the quickstart
    ("gsm8k_grpo", "model.tiny.hidden_size=32", "tiny: {hidden_size: 32}"),
])
def test_a_key_of_a_null_section_names_it_and_the_yaml_to_write(tmp_path, experiment, override, section):
    """OmegaConf cannot merge into a null section: Hydra printed its assert's whole traceback."""
    result = launch(f"+experiment={experiment}", override, f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"rft: config error: {override}: " in result.stderr and section in result.stderr
    assert "Traceback" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr


def test_another_error_on_a_command_line_with_such_a_key_is_still_hydras_short_report(tmp_path):
    result = launch("+experiment=quickstart", "data.arithmetic.nope=3", f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 1 and "Key 'nope' not in 'ArithmeticTaskConfig'" in result.stderr
    assert "Traceback" not in result.stderr


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
    assert "rank 0 failed: ValueError: taskset" in out and "has no valid rows" in out
    assert "Traceback" not in out + result.stderr  # the clear message only; the traceback is in the log
    log = out.split("log: ")[1].split()[0]
    assert os.path.exists(log) and log.endswith("_0_log.err")
    assert time.time() - started < 300
