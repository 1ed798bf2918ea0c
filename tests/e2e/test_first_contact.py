"""What a new user hits first, through the real launcher on a shortened quickstart: an overlong
row in the data, a rank killed mid-run and the run launched again with default settings, a second
launch into a live run's directory."""

import json
import os
import signal

from rft.buffer.shards import ExperienceBuffer
from rft.launch.job_state import process_running as alive
from tests.e2e.helpers import launch, launch_until_step, leftovers, stop_launcher, tensorboard_scalars

CONTEXT = 64  # the tiny model's max_position_embeddings (conf/model/tiny_qwen2.yaml)
# Trained, one row 20x the context made this rank reach 10.0 GiB in three SFT steps (attention over
# a 1290-token row, 64 rows per microbatch); skipped, the run peaks at ~0.7 GiB.
TRAINER_PEAK_GIB = 2.0


def _quickstart_data(tmp_path, long_row: dict | None = None):
    """A small arithmetic taskset pair (train, eval), each with `long_row` among its rows."""
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 60) for b in range(10, 30)]
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    with open(train, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps(row) + "\n")
            if i == 3 and long_row:
                f.write(json.dumps(long_row) + "\n")  # line 5
    with open(evals, "w") as f:
        f.writelines(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(40))
        if long_row:
            f.write(json.dumps(long_row) + "\n")  # line 41
    # 64 SFT rows a step (the recipe's 256 are for learning carries): enough for GRPO groups with a
    # reward spread, at a third of the step's cost
    return ["data.arithmetic=null", f"data.train_path={train}", f"data.eval_path={evals}",
            "stages.0.trainer.sft_batch_size=64"]


def test_overlong_row_is_skipped_counted_and_memory_stays_bounded(tmp_path):
    long_row = {"question": "1+1=" * (20 * CONTEXT // 4), "answer": "2"}  # 1280 tokens: 20x the context
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", *_quickstart_data(tmp_path, long_row),
                    "stages.0.trainer.max_steps=30", "stages.1.trainer.max_steps=3", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"<= {CONTEXT} tokens" in result.stdout  # the plan states the bound
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("train.jsonl", "eval.jsonl"):
        assert summary["skipped_rows"][str(tmp_path / name)]["overlong_skipped"] == 1
        assert f"skipped 1 rows longer than the model's context (data.overlong=skip) in {tmp_path / name}" \
            in " ".join(result.stdout.split())
    trainer = json.loads((run_dir / "metrics" / "summary-rank0.json").read_text())
    assert trainer["peak_rss_gb"] < TRAINER_PEAK_GIB, trainer["peak_rss_gb"]
    scalars = tensorboard_scalars(str(run_dir))
    assert {v for _, v in scalars["data/overlong_skipped"]} == {1.0, 2.0}  # SFT: train; GRPO: train + eval
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_log.out"))
    assert "line 5 needs 1282 tokens (prompt 1280 + response 2)" in logs  # SFT: answer "2" + EOS


SFT, GRPO = 40, 12


def _kill_rollout_rank_mid_grpo(tmp_path, *extra: str) -> tuple[list[str], str]:
    """Launch a short quickstart, kill -9 its rollout rank in GRPO, check what the launcher says;
    returns the launch's overrides and its stdout."""
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 *_quickstart_data(tmp_path), f"stages.0.trainer.max_steps={SFT}", f"stages.1.trainer.max_steps={GRPO}",
                 *extra]
    first = launch_until_step(overrides, run_dir, SFT + 3)  # in GRPO: experience is on disk
    try:
        os.kill(int((run_dir / "pids" / "rank1.pid").read_text()), signal.SIGKILL)
        out, err = first.communicate(timeout=120)
    finally:
        stop_launcher(first)
    assert first.returncode == 1
    # nothing of the failed launch lives on (its trainer once trained on the next launch's experience)
    assert not any(alive(int((run_dir / "pids" / f"rank{r}.pid").read_text())) for r in (0, 1))
    assert leftovers(run_dir, (0, 1)) == []  # nor what they started (vLLM's engine process)
    assert "rank 1 failed: rollout rank 1 was killed by SIGKILL (signal 9; its memory peaked at" in out
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err  # the message only
    return overrides, out


def _finished_once(run_dir) -> None:
    """The run ended as an uninterrupted one: all steps, each GRPO step's experience trained once."""
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == SFT + GRPO
    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    assert buffer.consumed() == [f"step{s:08d}-p001.parquet" for s in range(SFT, SFT + GRPO)]
    steps = sorted(s for s, _ in tensorboard_scalars(str(run_dir))["loss/policy"])
    assert steps == list(range(1, SFT + GRPO + 1))


def test_killed_rank_is_named_and_launching_again_finishes(tmp_path):
    """Default settings (no checkpoint in a short run): the launcher names the killed rank; the same
    command again starts over, keeping the killed attempt's files."""
    run_dir = tmp_path / "run"
    overrides, _ = _kill_rollout_rank_mid_grpo(tmp_path)
    killed_shards = os.listdir(run_dir / "buffer")

    again = launch(*overrides, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    plan = "".join(again.stdout.split("submitted job")[0].replace("│", " ").split())  # cells wrap long paths
    assert "".join(f"start over (no complete checkpoint to resume from); the earlier attempt's files are in "
                   f"{run_dir}/attempts/1".split()) in plan
    assert sorted(os.listdir(run_dir / "attempts" / "1" / "buffer")) == sorted(killed_shards)
    _finished_once(run_dir)  # the killed attempt's shards and events moved with it


def test_checkpoints_by_time_let_a_killed_run_resume(tmp_path):
    """trainer.save_every_min: every rank votes at each step whether the time has come, so all save
    the same step; launched again, the run resumes from the newest such checkpoint."""
    run_dir = tmp_path / "run"
    overrides, _ = _kill_rollout_rank_mid_grpo(tmp_path, "trainer.save_every_min=0.01")  # ~every step here
    again = launch(*overrides, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    plan = "".join(again.stdout.split("submitted job")[0].replace("│", " ").split())
    assert "attemptresumefrom" in plan and "stepsdone)" in plan
    assert not (run_dir / "attempts").exists()
    _finished_once(run_dir)


def test_second_launch_into_a_live_run_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 *_quickstart_data(tmp_path), "stages.0.trainer.max_steps=5000"]
    first = launch_until_step(overrides, run_dir, 1)
    try:
        second = launch(*overrides, timeout=120)
        assert second.returncode == 2
        assert f"run.output_dir={run_dir} is in use by the launch with pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None, "the refused launch must leave the first one alone"
        first.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = first.communicate(timeout=120)
    finally:
        stop_launcher(first)
    assert first.returncode == 130
    assert leftovers(run_dir, (0, 1)) == []  # Ctrl-C leaves no rank, and no vLLM engine, behind
    assert "interrupted: job" in out and f"run.output_dir={run_dir} to resume" in " ".join(out.split())
    assert "Traceback" not in out + err
    assert not (run_dir / "owner.json").exists()  # released: the next launch may take it
