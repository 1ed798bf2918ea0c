"""The plan's "on SIGTERM" row (rft/launch/plan.py): what a preemption or scancel costs (the step in
progress and a save: measured once the run has saved, estimated from the model's size before)
against what Slurm allows between its SIGTERM and its SIGKILL, with a warning when it may not fit."""

import json

import rft.launch.slurm
from rft.config import ClusterConfig, ModelConfig, RFTConfig, RunConfig
from rft.launch.plan import sigterm_line
from rft.runtime.checkpoint import record_save_timing

# an 8B-shaped decoder: 8.03e9 parameters
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 128256, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336}


def _cfg(tmp_path, **cluster) -> RFTConfig:
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA_8B))
    return RFTConfig(cluster=ClusterConfig(kind="slurm", **cluster), model=ModelConfig(path=str(model_dir), dtype="bfloat16"),
                     run=RunConfig(output_dir=str(tmp_path / "run")))


def _plain(line: str) -> str:
    return " ".join(line.split())


def test_a_measured_save_that_fits_only_a_preemption_warns_about_scancel(tmp_path, monkeypatch):
    monkeypatch.setattr(rft.launch.slurm, "kill_delays_s", lambda partition: (30, 120))
    cfg = _cfg(tmp_path)
    record_save_timing(cfg.run.output_dir, 40, save_s=21.5, step_s=14.0)
    line = _plain(sigterm_line(cfg))
    assert "Slurm kills 30 s after a scancel, 150 s after a preemption (KillWait, partition GraceTime)" in line
    assert "the last save took 21.5 s after a 14.0 s step (checkpoint of step 40)" in line
    assert "may not fit before a scancel's SIGKILL" in line and "preemption's" not in line
    assert "Slurm requeues a preempted job" in line


def test_an_unmeasured_8b_save_is_estimated_and_fits_a_long_grace(tmp_path, monkeypatch):
    monkeypatch.setattr(rft.launch.slurm, "kill_delays_s", lambda partition: (120, 300))
    # bf16 weights (2 bytes) and fp32 Adam state (12 bytes) per parameter, written by 8 trainer ranks:
    # 14.05 GB each, 14 s at the assumed 1 GB/s
    line = _plain(sigterm_line(_cfg(tmp_path, trainer_ranks=8, requeue=False)))
    assert "a save not measured yet: about 14.1 GB per trainer rank, 14 s at 1 GB/s" in line, line
    assert "may not fit" not in line
    assert "not requeued (cluster.requeue=false)" in line


def test_a_slurm_that_does_not_say_its_kill_wait_is_named_so(tmp_path, monkeypatch):
    monkeypatch.setattr(rft.launch.slurm, "kill_delays_s", lambda partition: (None, None))
    line = _plain(sigterm_line(_cfg(tmp_path)))
    assert "Slurm kills (scontrol did not say)" in line and "may not fit" not in line
