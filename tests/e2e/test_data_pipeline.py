"""The data pipeline in real runs: a task selector, experience operators and priority replay
survive a node failure (the resumed run selects, shapes and replays exactly what the uninterrupted
one did), replay's counts add up with every fresh shard trained once, and groups a person labels
during a run reach the trainer with the person's scores."""

import json
import os
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq

from rft.buffer.replay import replay_log
from rft.buffer.shards import ExperienceBuffer
from rft.runtime.equivalence import EXPLORER_STATE, TRAINER_STATE
from tests.e2e.helpers import REPO, assert_same_run, kill_like_a_node_failure, launch, wait_for_step

SFT_STEPS, GRPO_STEPS, SAVE_EVERY = 30, 18, 4  # a checkpoint at the last step (48) to compare
CHECKPOINT = SFT_STEPS + 10  # the kill comes after this checkpoint, before the next
DONE = SFT_STEPS + GRPO_STEPS
GROUPS_PER_STEP = 4


def _overrides(run_dir) -> list[str]:
    return ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
            f"trainer.save_interval={SAVE_EVERY}", f"stages.0.trainer.max_steps={SFT_STEPS}",
            f"stages.1.trainer.max_steps={GRPO_STEPS}", "+stages.1.data.selector.name=difficulty",
            f"buffer.replay.groups_per_step={GROUPS_PER_STEP}", "buffer.replay.max_uses=2",
            "buffer.operators=[dedup,{name: length_penalty, max_tokens: 6, buffer_tokens: 2}]",
            # the warm-up only has to make GRPO groups with a reward spread: 64 rows a step (the
            # recipe's 256 are for learning carries), one checkpoint at its end
            "stages.0.trainer.sft_batch_size=64", f"++stages.0.trainer.save_interval={SFT_STEPS}"]


def selections(run_dir) -> dict[str, list[str]]:
    """The task ids of every consumed shard, by shard: what the selector chose at each step."""
    buffer = ExperienceBuffer(os.path.join(run_dir, "buffer"))
    return {name: pq.read_table(os.path.join(buffer.root, name + ".done")).column("task_id").to_pylist()
            for name in buffer.consumed()}


def trainer_log(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics", "trainer0.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_killed_run_with_a_selector_operators_and_replay_resumes_exactly(tmp_path):
    reference = tmp_path / "uninterrupted"
    result = launch(*_overrides(reference))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "rft.launch", *_overrides(run_dir)], cwd=REPO,
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(first, run_dir, CHECKPOINT + 2)
    finally:
        kill_like_a_node_failure(first, run_dir)
    replayed_before_kill = replay_log(str(run_dir))
    assert any(entry["step"] > CHECKPOINT for entry in replayed_before_kill)  # lines the resumed run must drop
    result = launch(*_overrides(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # the same tasks at every step, the same groups replayed, the same state and metrics at the end
    want = selections(reference)
    assert list(want) == [f"step{s:08d}-p001.parquet" for s in range(SFT_STEPS, DONE)]  # each fresh shard once
    assert selections(run_dir) == want
    assert replay_log(str(run_dir)) == replay_log(str(reference))
    assert_same_run(reference, run_dir, DONE, {0: (*TRAINER_STATE, "replay"), 1: EXPLORER_STATE})

    # replay as configured: from the second GRPO step on, GROUPS_PER_STEP groups of earlier steps,
    # each at most twice, never its own step's; the counts in the log, TensorBoard's copy and the
    # shards agree
    log, rows = replay_log(str(reference)), trainer_log(reference)
    grpo = [r for r in rows if r["step"] > SFT_STEPS]
    assert [r["replay/groups"] for r in grpo] == [0.0] + [float(GROUPS_PER_STEP)] * (GRPO_STEPS - 1)
    assert sum(r["replay/rows"] for r in grpo) == sum(entry["rows"] for entry in log)
    uses: dict[str, int] = {}
    for entry in log:
        uses[entry["group_id"]] = uses.get(entry["group_id"], 0) + 1
        assert entry["uses"] == uses[entry["group_id"]] <= 2
        first_trained = int(entry["shard"][4:12]) + 1  # shard of explorer step s trains at trainer step s + 1
        assert first_trained < entry["step"]
    sizes = {name: pq.read_table(os.path.join(reference, "buffer", name + ".done")).column("group_id").to_pylist()
             for name in want}
    assert all(entry["rows"] == sizes[entry["shard"]].count(entry["group_id"]) for entry in log)
    # operators and selector reported each step
    rollout = [json.loads(line) for line in open(os.path.join(reference, "metrics", "rollout1.jsonl"))]
    grpo_rollout = [r for r in rollout if "ops/dedup/dropped" in r]
    assert len(grpo_rollout) == GRPO_STEPS and any(r["ops/dedup/dropped"] > 0 for r in grpo_rollout)
    assert grpo_rollout[-1]["selector/tasks_seen"] > 0


def test_groups_a_person_labels_during_the_run_are_trained_with_their_scores(tmp_path):
    """A reviewer (here a thread writing labels through the same call the TUI uses) scores every
    response of each group the `review` operator routes; the trainer takes each labelled group
    once, in a later step, with the reviewer's scores as its rewards."""
    import torch

    from rft.review.queue import label, labels, pending

    run_dir = tmp_path / "run"
    done = threading.Event()

    def reviewer():
        while not done.is_set():
            if os.path.isdir(run_dir / "review" / "queue"):
                for item in pending(str(run_dir)):
                    label(str(run_dir), item["id"], [1.0] * len(item["responses"]), "scored")
            time.sleep(0.05)

    thread = threading.Thread(target=reviewer, daemon=True)
    thread.start()
    try:
        result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "stages.0.trainer.max_steps=20",
                        "stages.1.trainer.max_steps=12", "trainer.save_interval=4", "buffer.operators=[{name: review, when: [sample], fraction: 0.1}]")
    finally:
        done.set()
        thread.join()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [r for r in trainer_log(run_dir) if "review/groups" in r]
    trained = sum(r["review/groups"] for r in rows)
    assert trained >= 1 and rows[-1]["review/labelled_total"] == trained
    state = torch.load(run_dir / "checkpoints" / f"step{20 + 12:08d}" / "rank0.pt", weights_only=False)["review"]
    assert len(state["trained"]) == len(set(state["trained"])) == trained  # each labelled group once
    assert set(state["trained"]) <= set(labels(str(run_dir)))
    # a step that trained labelled groups (all scored 1.0 by the reviewer) has their rewards in its mean:
    # at least their share of the rows, whatever the fresh rows scored (0 or 1 with exact_match).
    # The mean is a float32: when every fresh row scored 0 it is 48/304 rounded, so compare within
    # float32's relative precision rather than an absolute 1e-6.
    for r in rows:
        if r["review/rows"]:
            assert r["reward/mean"] * (r["review/rows"] + 32 * 8) >= r["review/rows"] * (1 - 1e-6)


def test_a_judge_scores_every_task_once_and_the_curriculum_opens_with_the_lowest(tmp_path, exported_sft_model):
    """data.judge_difficulty with a real judge engine: the quickstart's SFT'd model reads each
    "a+b=" task through the template "{prompt}" and answers with a number (its sum, standing in for
    a judge's rating), once per task before the GRPO stage; that number is the task's difficulty,
    and the curriculum's batches come from the lowest quarter of them."""
    from rft.data.judge_difficulty import first_number

    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "model.tiny=null",
                    f"model.path={exported_sft_model}", "data.arithmetic.num_train=64", "data.arithmetic.num_eval=8",
                    "cluster.judge_ranks=1", "judge.kv_cache_gb=0.25", "rollout.tasks_per_step=8",
                    "stages=[{name: grpo, algorithm: {name: grpo, lr: 3.0e-4}, trainer: {max_steps: 3}}]",
                    "data.judge_difficulty={enabled: true, chat: false, prompt: '{prompt}', max_new_tokens: 4}",
                    "data.selector={name: curriculum, start_fraction: 0.25, pacing: step, pace_steps: 1000}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rank_logs = "".join(open(path).read() for path in (run_dir / "logs").glob("*_log.out"))
    assert rank_logs.count("data.judge_difficulty: 64 tasks scored") == 1  # with progress, by engine 0
    rows = [json.loads(line) for line in open(run_dir / "data" / "grpo" / "train.difficulty.jsonl")]
    summary, scores = rows[0]["summary"], {row["id"]: row for row in rows[1:]}
    assert len(scores) == 64 and summary["failed"] == 0
    parsed = [row for row in scores.values() if first_number(row["reply"]) is not None]
    assert all(row["score"] == first_number(row["reply"]) for row in parsed)
    assert len(parsed) == 64 - summary["unparsed"]
    # the judge read the task: the SFT'd model's number is the task's sum for most of them
    tasks = [json.loads(line) for line in open(run_dir / "data" / "train.jsonl")]
    right = sum(scores[str(i)]["score"] == float(task["answer"]) for i, task in enumerate(tasks))
    assert right >= 32, right
    assert json.load(open(run_dir / "summary.json"))["judge"]["calls"] == 64  # asked once, before the stage

    # every step's tasks are among the 16 lowest scores (ties in file order, as the curriculum sorts)
    lowest = set(sorted(scores, key=lambda i: (scores[i]["score"], int(i)))[:16])
    chosen = selections(str(run_dir))
    assert len(chosen) == 3 and all(set(ids) <= lowest for ids in chosen.values()), (chosen, lowest)
