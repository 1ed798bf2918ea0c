"""A run saved at one trainer layout resumes at another: its checkpoint holds the model and the
optimizer layout-free (megatron-core's dist_checkpointing, rft/trainer/sharded_state.py), so a run
killed at TP=2 continues at TP=1 on one rank, or at PP=2, and its next steps train as the run
that never stopped did; a mixture-of-experts run saved with its experts split over two ranks
(EP=2) continues with every rank holding all of them (EP=1).

SFT (mode=train) on the quickstart's tasks, with its tiny model or a tiny Qwen3-MoE: no rollout
ranks, so the number of trainer ranks may change too."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.e2e.helpers import launch

STEPS, SAVE_EVERY, KILLED_AT = 6, 3, 5
SFT = ("+experiment=quickstart", "mode=train", "stages=[]", "algorithm=sft", "algorithm.lr=3e-3",
       f"trainer.max_steps={STEPS}", "trainer.sft_batch_size=64", f"trainer.save_interval={SAVE_EVERY}",
       "trainer.save_every_min=0", "data.eval_limit=20")
TP2 = ("cluster.trainer_ranks=2", "trainer.tensor_parallel_size=2")


def losses(run_dir: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) as the trainer logged them (a resumed run's own lines last)."""
    rows = {}
    with open(os.path.join(run_dir, "metrics", "trainer0.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = (row["loss/policy"], row["actor/grad_norm"])
    return rows


def _whole_and_killed(root, *layout: str) -> tuple[str, str]:
    """(a run that never stopped, a run killed in step 5 with its checkpoint of step 3)."""
    whole, killed = str(root / "whole"), str(root / "killed")
    done = launch(*SFT, *layout, f"run.output_dir={whole}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stopped = launch(*SFT, *layout, f"run.output_dir={killed}",
                     env={**os.environ, "RFT_FAULTS": f"kill_train@{KILLED_AT}#0"})
    assert stopped.returncode != 0, stopped.stdout[-3000:]
    assert os.path.isdir(os.path.join(killed, "checkpoints", f"step{SAVE_EVERY:08d}", "sharded"))
    return whole, killed


def _resumed_trains_as_whole(whole: str, killed: str, run_dir: str, *layout: str) -> None:
    shutil.copytree(killed, run_dir)
    resumed = launch(*SFT, *layout, f"run.output_dir={run_dir}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    logs = "".join(open(os.path.join(run_dir, "logs", name)).read() for name in os.listdir(os.path.join(run_dir, "logs"))
                   if name.endswith("_log.out"))
    assert f"checkpoints/step{SAVE_EVERY:08d} ({SAVE_EVERY} steps done)" in logs
    want, got = losses(whole), losses(run_dir)
    for step in range(SAVE_EVERY + 1, STEPS + 1):  # the steps trained after the resume
        # another layout sums in another order: equal to float32 rounding (measured: the losses
        # equal to 1e-15, the grad norms to 1e-7)
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-5), (step, got[step], want[step])
        assert got[step][1] == pytest.approx(want[step][1], rel=1e-4), (step, got[step], want[step])
    assert want[STEPS][0] < want[SAVE_EVERY][0] - 0.1  # the steps after the resume learned something


@pytest.fixture(scope="module")
def killed_at_tp2(tmp_path_factory) -> tuple[str, str]:
    return _whole_and_killed(tmp_path_factory.mktemp("reshard"), *TP2)


@pytest.mark.parametrize("layout", [("cluster.trainer_ranks=1",),  # TP=1 on one rank
                                    ("cluster.trainer_ranks=2", "trainer.pipeline_parallel_size=2")],
                         ids=["tp1", "pp2"])
def test_a_run_saved_at_tp2_resumes_at_another_layout_and_trains_as_if_never_stopped(killed_at_tp2, layout, tmp_path):
    _resumed_trains_as_whole(*killed_at_tp2, str(tmp_path / "run"), *layout)


def test_a_moe_run_saved_at_ep2_resumes_at_ep1_and_trains_as_if_never_stopped(tmp_path):
    """Two trainer ranks (DP=2) both times, so each rank's microbatches, and with them the routers'
    load-balancing losses, are the same before and after."""
    from tests.dist.dist_models import create_family_model

    model = create_family_model("qwen3_moe", str(tmp_path / "moe"))
    moe = ("model.tiny=null", f"model.path={model}", "cluster.trainer_ranks=2")
    whole, killed = _whole_and_killed(tmp_path, *moe, "trainer.expert_parallel_size=2")
    _resumed_trains_as_whole(whole, killed, str(tmp_path / "run"), *moe, "trainer.expert_parallel_size=1")


def test_a_torn_shard_file_is_told_and_its_checkpoint_set_aside(killed_at_tp2, tmp_path):
    """The sharded files are checked against the sha256 their rank recorded, as rank files are: a
    flipped byte stops the resume naming the file, and sets the checkpoint aside."""
    _, killed = killed_at_tp2
    run_dir = str(tmp_path / "run")
    shutil.copytree(killed, run_dir)
    step_dir = os.path.join(run_dir, "checkpoints", f"step{SAVE_EVERY:08d}")
    torn = os.path.join(step_dir, "sharded", "__1_0.distcp")  # trainer rank 1's: checked by rank 0 at TP=1
    with open(torn, "r+b") as f:
        f.seek(os.path.getsize(torn) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = launch(*SFT, "cluster.trainer_ranks=1", f"run.output_dir={run_dir}")
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0
    assert "__1_0.distcp does not match the sha256 recorded when it was written" in said, said[-3000:]
    assert os.path.isdir(step_dir + ".corrupt") and not os.path.exists(step_dir)


def test_rft_export_of_a_tp2_checkpoint_gives_the_runs_own_export(killed_at_tp2, tmp_path):
    """`python -m rft.export` turns the TP=2 run's last checkpoint into an HF directory in one
    process (TP=1): the same tensors, bit for bit, as the run's own export of that step (its final
    model, <run>/model), and the same files beside them."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    whole, out = killed_at_tp2[0], tmp_path / "hf"
    wrong = subprocess.run([sys.executable, "-m", "rft.export", whole, "--step", "5"], capture_output=True, text=True)
    assert wrong.returncode == 2 and f"has no checkpoint of that step; it has [{SAVE_EVERY}, {STEPS}]" in wrong.stderr
    done = subprocess.run([sys.executable, "-m", "rft.export", whole, "--step", str(STEPS), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rft.export: checkpoint step {STEPS} (stage main; trainer_ranks=2) of {whole}" in done.stdout
    assert not done.stderr.strip(), done.stderr[-2000:]  # no third-party warnings on the user's terminal

    def tensors(directory) -> dict:
        found = {}
        for name in os.listdir(directory):
            if name.endswith(".safetensors"):
                found.update(load_file(os.path.join(directory, name)))
        return found

    own, converted = tensors(os.path.join(whole, "model")), tensors(out)
    assert sorted(own) == sorted(converted)
    assert all(own[name].equal(converted[name]) for name in own)
    assert set(os.listdir(os.path.join(whole, "model"))) == set(os.listdir(out))
