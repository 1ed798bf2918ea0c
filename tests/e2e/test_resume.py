"""A run stopped in the middle and launched again with the same output dir ends as the
uninterrupted run does, bit for bit: the same metrics at every step and the same weights, optimizer
state and RNG in its final checkpoint. Stopped two ways: killed without warning (node failure: every
process SIGKILLed; it resumes from its newest periodic checkpoint) and by the time-limit signal
(SIGUSR2: every rank saves at the same step and stops). Killed, experience written after the
checkpoint is set aside and produced again, each shard is consumed once, and TensorBoard shows each
step once. With `sync.offset` the explorer's checkpoint is ahead of the trainer's: the shards
between them are kept (returned to the pool if the trainer took them).

Nothing had to be pinned for equality on CPU beyond what a run already fixes: the seed, one
sampling seed per (step, task, sample) that never depends on the engine or on the order requests
finish (rft/explorer/runner.py), the taskset cursor and every RNG state in the checkpoint, and the
weights a restarted explorer gets from the trainer's first sync, before its first rollout."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rft.buffer.shards import ExperienceBuffer
from rft.runtime.equivalence import EXPLORER_STATE, TRAINER_STATE
from tests.e2e.helpers import (
    REPO,
    assert_same_run,
    kill_like_a_node_failure,
    launch,
    launch_until_step,
    mlflow_server,
    stopped_by_fault,
    tensorboard_scalars,
    tracked_steps,
    wait_for_step,
)

SFT_STEPS, GRPO_STEPS, SAVE_EVERY = 30, 20, 5
CHECKPOINT = SFT_STEPS + 10  # the kill comes after this checkpoint, before the next
TORN = SFT_STEPS + 5  # the shard of this step reaches the disk torn (in the kill -9 test)
DONE = SFT_STEPS + GRPO_STEPS
FINAL_STATE = {0: TRAINER_STATE, 1: EXPLORER_STATE}  # the state that must match: the trainer's, the explorer's


def _overrides(run_dir, offset: int) -> list[str]:
    return ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
            f"trainer.save_interval={SAVE_EVERY}", f"stages.0.trainer.max_steps={SFT_STEPS}",
            f"stages.1.trainer.max_steps={GRPO_STEPS}", f"sync.offset={offset}",
            # the warm-up only has to make GRPO groups with a reward spread: 64 rows a step (the
            # recipe's 256 are for learning carries), one checkpoint at its end (the kills are in GRPO)
            "stages.0.trainer.sft_batch_size=64", f"++stages.0.trainer.save_interval={SFT_STEPS}"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run directory of the uninterrupted run, by sync.offset (each made once for the module)."""
    runs: dict[int, str] = {}

    def run(offset: int) -> str:
        if offset not in runs:
            run_dir = tmp_path_factory.mktemp(f"uninterrupted{offset}") / "run"
            result = launch(*_overrides(run_dir, offset))
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            runs[offset] = str(run_dir)
        return runs[offset]

    return run


# sync.offset 1 only: the explorer's checkpoint ahead of the trainer's is the harder case, and
# tests/e2e/test_chaos.py kills ranks of a run at offset 0 and checks it ends bit for bit
@pytest.mark.parametrize("offset", [1])
def test_killed_run_resumes_from_its_checkpoint_when_launched_again(tmp_path, offset, uninterrupted):
    """Also tracked in MLflow (its own server) and W&B (offline) besides TensorBoard: after the kill
    and the relaunch each rank has one run in each, holding every scalar at every step once."""
    run_dir = tmp_path / "run"
    with mlflow_server(tmp_path / "mlflow") as tracking_uri:
        overrides = [*_overrides(run_dir, offset), "monitor.loggers=[tensorboard,mlflow,wandb]",
                     f"monitor.mlflow.tracking_uri={tracking_uri}", "monitor.plots=true"]
        first_ids, wandb_through = _killed_and_resumed(run_dir, overrides, offset, uninterrupted)
        for rank in TRACKED:
            tracked = tracked_steps(run_dir, rank, tracking_uri)
            # W&B keeps one row per step (two evals at a stage boundary's step are one row): each step once.
            # The steps from the checkpoint on that the killed attempt's W&B files held stay its rows (the
            # resumed rank logs after them, rft/runtime/trackers/wandb_tracker.py), and at the checkpoint
            # step that row has the killed attempt's weight sync, which the resumed run logs differently.
            # Which steps those are depends on how far W&B's service, writing behind the run, had got
            # when the kill landed: read from its files, they are checked to be there once; the rest key by key
            held = range(CHECKPOINT, wandb_through[rank] + 1)
            wandb = {key: [s for s in steps if s not in held] for key, steps in tracked["wandb"].items()}
            jsonl = {key: sorted({s for s in steps if s not in held}) for key, steps in tracked["jsonl"].items()}
            assert {k: v for k, v in wandb.items() if v} == {k: v for k, v in jsonl.items() if v}, rank
            assert all(len(steps) == len(set(steps)) for steps in tracked["wandb"].values()), rank
            assert {s for steps in tracked["jsonl"].values() for s in steps if s in held} <= \
                {s for steps in tracked["wandb"].values() for s in steps}, rank
            assert set(tracked["mlflow"]) == set(tracked["jsonl"]), rank
            for key, steps in tracked["mlflow"].items():  # each point as often as the jsonl has it
                logged = [s for s in steps if s in tracked["jsonl"][key]]
                assert logged == tracked["jsonl"][key], (rank, key, steps)
                # MLflow cannot delete a point: a scalar the killed attempt logged after the checkpoint
                # was saved that the resumed run does not log again stays (the torn shard's count, met
                # once; the checkpoint step's own weight sync, which comes after its save)
                extra = [s for s in steps if s not in tracked["jsonl"][key]]
                assert len(set(extra)) == len(extra) and all(s >= CHECKPOINT for s in extra), (rank, key, steps)
        from mlflow import MlflowClient

        runs = MlflowClient(tracking_uri).search_runs([MlflowClient(tracking_uri).get_experiment_by_name("quickstart")
                                                      .experiment_id])
        group = f"{tmp_path.name}/run"  # monitor.group: the run directory's last two names
        assert sorted(r.info.run_name for r in runs) == [f"{group}/{rank}" for rank in sorted(TRACKED)]
        assert {rank: _tracker_ids(run_dir, rank) for rank in TRACKED} == first_ids
    assert (run_dir / "plots" / "sft.png").exists() and (run_dir / "plots" / "grpo.svg").exists()


TRACKED = ("trainer0", "rollout1")  # the ranks that log


def _tracker_ids(run_dir, rank: str) -> dict[str, str]:
    return json.loads((run_dir / "metrics" / f"{rank}.trackers.json").read_text())


def _killed_and_resumed(run_dir, overrides, offset, uninterrupted) -> tuple[dict[str, dict[str, str]], dict[str, int]]:
    """Kill the run after its checkpoint, launch it again, check it ended as the uninterrupted run;
    the trackers' run ids of each rank after the kill, and the last step of each rank W&B's files
    held then."""
    from rft.runtime.trackers.wandb_files import history

    explorer_saved = CHECKPOINT + offset  # shards [0, explorer_saved) are in the explorer's checkpoint
    # the kill comes once the trainer has logged CHECKPOINT + 2 and the explorer has stopped itself
    # (SIGSTOP) as it was about to generate the step after the one it took those weights for: the
    # trainer then waits for the explorer and cannot reach the next checkpoint, however fast its steps
    # are. (Killing "at once" after step CHECKPOINT + 2 left the run SAVE_EVERY - 2 steps to get there.)
    stopped_at = CHECKPOINT + 3 + offset
    # on the way, the shard of step TORN reaches the disk torn (rft/runtime/faults.py): the trainer
    # quarantines it, the explorer writes it again from its copy, the run goes on as if not
    first = subprocess.Popen([sys.executable, "-m", "rft.launch", *overrides], cwd=REPO, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "RFT_FAULTS": f"corrupt_shard@{TORN},stop_generating@{stopped_at}#1"})
    try:
        wait_for_step(first, run_dir, CHECKPOINT + 2)
        deadline = time.monotonic() + 300  # only bounds a hang
        while stopped_by_fault(run_dir, "stop_generating", stopped_at, 1) is None:
            assert first.poll() is None and time.monotonic() < deadline, f"the explorer never stopped at {stopped_at}"
            time.sleep(0.2)
    finally:
        kill_like_a_node_failure(first, run_dir)
    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    written_after_checkpoint = [n for n in os.listdir(buffer.root) if n.startswith("step")
                                and int(n[4:12]) >= explorer_saved]
    assert written_after_checkpoint, "the kill came before any experience past the checkpoint"

    first_ids = {rank: _tracker_ids(run_dir, rank) for rank in TRACKED}
    wandb_through = {rank: max((row["_step"] for row in history(str(run_dir), ids["wandb"])), default=-1)
                     for rank, ids in first_ids.items()}
    result = launch(*overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "plots: " in result.stdout
    for rank in (0, 1):
        log = next((run_dir / "logs").glob(f"*_{rank}_log.out"), None)
        logs = "".join(p.read_text() for p in (run_dir / "logs").glob(f"*_{rank}_log.out"))
        assert log is not None and f"checkpoints/step{CHECKPOINT:08d} ({CHECKPOINT} steps done)" in logs
        if rank == 1 and offset:  # the trainer had trained CHECKPOINT, CHECKPOINT + 1 after its checkpoint
            assert f"ready again (steps {CHECKPOINT} to {explorer_saved - 1})" in logs
        summary = json.loads((run_dir / "metrics" / f"summary-rank{rank}.json").read_text())
        assert summary["steps"] == SFT_STEPS + GRPO_STEPS

    assert buffer.consumed() == [f"step{s:08d}-p001.parquet" for s in range(SFT_STEPS, SFT_STEPS + GRPO_STEPS)]
    assert buffer.pending() == []
    set_aside = os.listdir(run_dir / "buffer" / "rolled_back" / f"resume0-step{explorer_saved:08d}")
    assert sorted(n.split(".")[0] for n in set_aside) == sorted(n.split(".")[0] for n in written_after_checkpoint)

    scalars = tensorboard_scalars(str(run_dir))
    assert sorted(s for s, _ in scalars["loss/policy"]) == list(range(1, SFT_STEPS + GRPO_STEPS + 1))
    assert sorted(s for s, _ in scalars["timing/rollout_s"]) == list(range(SFT_STEPS + 1, SFT_STEPS + GRPO_STEPS + 1))
    trainer_log = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trainer_log] == list(range(1, SFT_STEPS + GRPO_STEPS + 1))
    torn = f"step{TORN:08d}-p001.parquet"
    assert (run_dir / "buffer" / f"{torn}.corrupt-1").exists()  # quarantined by the trainer, kept
    assert f"shard {torn} failed its checksum at the trainer; written again" in \
        "".join(p.read_text() for p in (run_dir / "logs").glob("*_1_log.out"))
    assert [r.get("buffer/corrupt_shards") for r in trainer_log if TORN < r["step"] <= CHECKPOINT] == \
        [1.0] * (CHECKPOINT - TORN)
    assert_same_run(uninterrupted(offset), run_dir, DONE, FINAL_STATE)  # the torn shard's experience trained once
    return first_ids, wandb_through


# offset 0 is stopped by the signal in test_a_full_disk_stops_the_run..., before its disk fills
def test_a_time_limit_stop_then_a_full_disk_lose_nothing_and_the_run_resumes_once_space_is_back(tmp_path, uninterrupted):
    """Stopped by the time-limit signal first (every rank saves the same step and stops; the
    explorer a step ahead, sync.offset 1), then launched again into a full disk: nothing torn, and
    once space is back the run ends as if never stopped."""
    run_dir = tmp_path / "run"
    overrides = _overrides(run_dir, 1)
    launcher = launch_until_step(overrides, run_dir, CHECKPOINT + 2)  # first a checkpoint to resume from
    for pid_file in (run_dir / "pids").glob("rank*.pid"):  # what Slurm sends every task before the limit
        os.kill(int(pid_file.read_text()), signal.SIGUSR2)
    out, err = launcher.communicate(timeout=300)
    # not a Slurm job, so not requeued: it stops, saying how to resume
    assert launcher.returncode != 0 and "launch again with run.output_dir=" in out + err, out[-3000:] + err[-3000:]
    stopped_at = max(int(p.name[4:]) for p in (run_dir / "checkpoints").glob("step*"))
    assert CHECKPOINT + 2 <= stopped_at < DONE

    # Launched again, the trainer's next checkpoint (4.9 MB) finds no room: a 1 MiB file size limit,
    # set on the ranks as they save it (rft/runtime/faults.py), the test machine's stand-in for a full
    # filesystem (the kernel's EFBIG instead of ENOSPC, handled alike)
    failed_at = (stopped_at // SAVE_EVERY + 1) * SAVE_EVERY
    full = launch(*overrides, env={**os.environ, "RFT_FAULTS": f"file_size_limit@{failed_at}"})
    said = full.stdout + full.stderr
    assert full.returncode != 0, said[-3000:]
    assert f"file size limit (ulimit -f) is reached while writing the checkpoint of rank 0 at step {failed_at}" in said
    assert "launch again with the same run.output_dir" in said
    left = os.listdir(run_dir / "checkpoints" / f"step{failed_at:08d}")
    assert "rank0.pt" not in left and not [n for n in left if ".tmp" in n], left  # nothing torn, nothing half-written

    result = launch(*overrides)  # space is back
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_log.out"))
    assert f"checkpoints/step{stopped_at:08d} ({stopped_at} steps done)" in logs
    assert_same_run(uninterrupted(1), run_dir, DONE, FINAL_STATE)
