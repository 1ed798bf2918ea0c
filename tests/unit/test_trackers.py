"""The trackers behind `monitor.loggers`, with the real clients: MLflow on an SQLite store (its
server is in tests/e2e/test_resume.py), W&B offline (its files read back), TensorBoard's event
files; a user's tracker by dotted path; a tracker that cannot reach its server costs one warning and
nothing else; and the checks at launch."""

import json
import subprocess
import sys
import time

import pytest

from rft.config import RFTConfig
from rft.runtime.monitor import Monitor
from rft.runtime.storage import read_jsonl
from rft.runtime.trackers import check_trackers
from rft.runtime.trackers.wandb_files import history
from tests.e2e.helpers import tensorboard_scalars

STEPS = [{"loss/policy": 0.5 / s, "reward/mean": s / 10, "data/rows": 3.0} for s in range(1, 7)]

RECEIVED: list[tuple[str, int, dict]] = []  # what UserTracker instances were given, in order


class UserTracker:
    """A user's tracker, selected by its dotted path."""

    def __init__(self, cfg, run):
        self.name = run.name

    def log(self, step, scalars):
        RECEIVED.append((self.name, step, dict(scalars)))

    def flush(self):
        RECEIVED.append((self.name, -1, {}))

    def close(self):
        pass


def _cfg(run_dir, *loggers: str) -> RFTConfig:
    cfg = RFTConfig()
    cfg.run.output_dir, cfg.run.name, cfg.monitor.group = str(run_dir), "unit", "unit/run"
    cfg.monitor.loggers = list(loggers)
    cfg.monitor.mlflow.tracking_uri = f"sqlite:///{run_dir}/mlflow.db"
    return cfg


def _log(monitor: Monitor, steps: range) -> None:
    for step in steps:
        monitor.log(step, STEPS[step - 1], "grpo")


def _mlflow_steps(run_dir, rank: str) -> tuple[str, dict[str, list[int]]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    run_id = json.loads((run_dir / "metrics" / f"{rank}.trackers.json").read_text())["mlflow"]
    keys = client.get_run(run_id).data.metrics
    return run_id, {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def test_every_tracker_gets_every_scalar_once_and_a_resumed_rank_goes_on_in_the_same_runs(tmp_path):
    """A rank logs steps 1-5, saves at step 3 (flush), dies; resumed at its checkpoint it logs 3-6
    again. MLflow and W&B each hold one run with steps 1-6 once; TensorBoard hides the repeated ones."""
    RECEIVED.clear()
    cfg = _cfg(tmp_path, "tensorboard", "mlflow", "wandb", f"{__name__}.UserTracker")
    first = Monitor(cfg, "trainer0")
    _log(first, range(1, 3))
    first.flush()  # a checkpoint after step 2: the resumed rank starts at step 3
    _log(first, range(3, 6))
    first.close()
    mlflow_id, _ = _mlflow_steps(tmp_path, "trainer0")
    wandb_id = json.loads((tmp_path / "metrics" / "trainer0.trackers.json").read_text())["wandb"]

    second = Monitor(cfg, "trainer0", resume_step=3)
    _log(second, range(3, 7))
    second.close()

    logged = read_jsonl(str(tmp_path / "metrics" / "trainer0.jsonl"))
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    run_id, steps = _mlflow_steps(tmp_path, "trainer0")
    assert run_id == mlflow_id and steps == {key: [1, 2, 3, 4, 5, 6] for key in STEPS[0]}
    from mlflow import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.info.run_name == "unit/run/trainer0" and run.data.tags["rft.group"] == "unit/run"
    assert run.data.params["algorithm.name"] == "grpo" and run.data.params["monitor.group"] == "unit/run"
    assert run.info.status == "FINISHED"

    ids = json.loads((tmp_path / "metrics" / "trainer0.trackers.json").read_text())
    assert ids["wandb"] == wandb_id
    rows = written_history(str(tmp_path), wandb_id, 6)  # both attempts' offline files, as `wandb sync` uploads them
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3] == {"_step": 4, **STEPS[3]}

    board = tensorboard_scalars(str(tmp_path))
    assert sorted(s for s, _ in board["loss/policy"]) == [1, 2, 3, 4, 5, 6]

    assert [step for _, step, _ in RECEIVED] == [1, 2, -1, 3, 4, 5, 3, 4, 5, 6]  # a user's tracker gets it all
    assert RECEIVED[0] == ("unit/run/trainer0", 1, STEPS[0])


def test_steps_a_killed_rank_never_sent_to_mlflow_are_sent_again_from_the_jsonl(tmp_path):
    """A kill -9 loses the batches still in flight, also of the checkpoint's step, which the resumed
    rank does not log again: the resumed tracker sends what the jsonl has and the server lacks."""
    cfg = _cfg(tmp_path, "mlflow")
    first = Monitor(cfg, "trainer0")
    _log(first, range(1, 3))
    first.flush()
    lost = first.trackers.active.pop("mlflow")  # step 3 reaches the jsonl, never the server
    _log(first, range(3, 4))
    lost.flush()
    second = Monitor(cfg, "trainer0", resume_step=4)  # the checkpoint after step 3
    _log(second, range(4, 7))
    second.close()
    assert _mlflow_steps(tmp_path, "trainer0")[1] == {key: [1, 2, 3, 4, 5, 6] for key in STEPS[0]}


def test_a_run_that_never_checkpoints_keeps_a_bounded_number_of_mlflow_batches_in_flight(tmp_path, monkeypatch):
    import rft.runtime.trackers.mlflow_tracker as mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "MAX_PENDING", 2)
    monitor = Monitor(_cfg(tmp_path, "mlflow"), "trainer0")
    tracker = monitor.trackers.get("mlflow")
    in_flight = []
    for step in range(1, 6):
        monitor.log(step, STEPS[step - 1], "grpo")
        in_flight.append(len(tracker.pending))
    monitor.close()
    assert max(in_flight) < 2, in_flight
    assert _mlflow_steps(tmp_path, "trainer0")[1] == {key: [1, 2, 3, 4, 5] for key in STEPS[0]}


def test_an_unreachable_server_costs_one_warning_and_the_scalars_stay(tmp_path, capfd):
    cfg = _cfg(tmp_path, "tensorboard", "mlflow")
    cfg.monitor.mlflow.tracking_uri = "http://127.0.0.1:9"  # the discard port: nothing listens
    monitor = Monitor(cfg, "rollout1")
    _log(monitor, range(1, 4))
    monitor.close()
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("rft: warning")]
    assert len(warnings) == 1 and "monitor.loggers: mlflow could not start" in warnings[0], err
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics" / "rollout1.jsonl"))] == [1, 2, 3]
    assert sorted(s for s, _ in tensorboard_scalars(str(tmp_path))["reward/mean"]) == [1, 2, 3]


class FailsLater(UserTracker):
    def log(self, step, scalars):
        if step == 2:
            raise ConnectionError("quota exceeded")


def test_a_tracker_that_fails_mid_run_is_reported_once_and_left_out(tmp_path, capfd):
    monitor = Monitor(_cfg(tmp_path, f"{__name__}.FailsLater"), "trainer0")
    _log(monitor, range(1, 5))
    monitor.close()
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("rft: warning")]
    assert warnings == [f"rft: warning: monitor.loggers: {__name__}.FailsLater failed in log() (ConnectionError: "
                        "quota exceeded); the run goes on without it, its scalars stay in metrics/*.jsonl"]
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics" / "trainer0.jsonl"))] == [1, 2, 3, 4]


@pytest.mark.parametrize("loggers, key, says", [
    (["tensorboard", "neptune"], "monitor.loggers", "unknown experiment tracker 'neptune'"),
    (["tensorboard", "tensorboard"], "monitor.loggers", "names a tracker twice"),
    (["wandb"], "monitor.wandb.mode", "use offline"),
    ([f"{__name__}.STEPS"], "monitor.loggers", "not a class"),
])
def test_launch_checks_name_the_key(tmp_path, loggers, key, says):
    cfg = _cfg(tmp_path, *loggers)
    cfg.monitor.wandb.mode = "cloud"
    with pytest.raises(ValueError) as err:
        check_trackers(cfg)
    assert str(err.value).startswith(key) and says in str(err.value)


def test_the_launcher_refuses_an_unknown_tracker_before_anything_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=local",
                             f"run.output_dir={tmp_path}", "monitor.loggers=[tensorboard,mlfow]"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "monitor.loggers" in result.stderr and "mlflow" in result.stderr
    assert "Traceback" not in result.stderr


def written_history(wandb_dir: str, run_id: str, rows: int, timeout_s: float = 60.0) -> list[dict]:
    """The offline run's history once W&B's service has written `rows` rows (or what it holds after
    `timeout_s`): `finish()` returns before its service process has flushed the file, and on a loaded
    machine (CI's 2 cores) the read came first and found none."""
    deadline = time.time() + timeout_s
    found = history(wandb_dir, run_id)
    while len(found) < rows and time.time() < deadline:
        time.sleep(0.2)
        found = history(wandb_dir, run_id)
    return found


def test_steps_a_killed_rank_never_wrote_to_wandb_are_logged_again_from_the_jsonl(tmp_path):
    """W&B's service writes behind the run: a rank killed -9 can lose steps from before its
    checkpoint, which the resumed rank does not compute again. Simulated at its worst: the first
    attempt's offline files are lost entirely; the resumed rank logs steps 1-3 from the jsonl."""
    import shutil

    cfg = _cfg(tmp_path, "wandb")
    first = Monitor(cfg, "trainer0")
    _log(first, range(1, 6))
    first.close()
    run_id = json.loads((tmp_path / "metrics" / "trainer0.trackers.json").read_text())["wandb"]
    for lost in (tmp_path / "wandb").glob(f"offline-run-*-{run_id}"):
        shutil.rmtree(lost)
    second = Monitor(cfg, "trainer0", resume_step=4)
    _log(second, range(4, 7))
    second.close()
    rows = written_history(str(tmp_path), run_id, 6)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[0] == {"_step": 1, **STEPS[0]}
