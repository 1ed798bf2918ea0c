"""The review loop's two ends in rft (rft/buffer/review.py): the `review` operator routes the groups
its rules match to the queue, and the trainer's intake turns labelled groups into rows whose
rewards are the person's scores, each group once, across a restart."""

import pytest

from rft.buffer.experience import Experience, from_table
from rft.buffer.operators import OperatorContext, OperatorPipeline
from rft.buffer.review import ReviewIntake
from rft.review.queue import items, label


def group(name: str, rewards: list[float], metrics: list[dict] | None = None) -> list[Experience]:
    return [Experience(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.25],
                       prompt_length=2, reward=r, group_id=name, trajectory_id=f"{name}:{k}", task_id=name,
                       response=f"answer {k}", metrics=(metrics or [{}] * len(rewards))[k])
            for k, r in enumerate(rewards)]


def route(run_dir, rows, **options):
    ctx = OperatorContext(str(run_dir), step=7, decode=lambda ids: " ".join(map(str, ids)))
    return OperatorPipeline([("review", options)], ctx)(rows)


def test_the_rules_route_whole_groups_and_keep_or_hold_them(tmp_path):
    rows = (group("flag", [1, 0], [{}, {"flagged": 1}]) + group("judged", [1, 0], [{"judge": 0.0}, {"judge": 0.1}])
            + group("calm", [1, 1], [{"judge": 1.0}, {"judge": 0.9}]))
    kept = route(tmp_path, rows, when=["flagged", "disagree"], tolerance=0.5)
    assert kept == rows  # keep: the groups train now as well
    queued = {item["id"]: item for item in items(str(tmp_path))}
    assert sorted(queued) == ["flag", "judged"]
    assert queued["flag"]["reason"] == "flagged (flagged)" and queued["flag"]["prompt"] == "5 6"
    assert queued["judged"]["reason"] == "judge and reward disagree by 1.00"
    assert [r["text"] for r in queued["flag"]["responses"]] == ["answer 0", "answer 1"]
    held = route(tmp_path / "other", rows, when=["flagged"], keep=False)
    assert {e.group_id for e in held} == {"judged", "calm"}  # held back until reviewed


def test_sampling_a_fraction_is_stable_per_group(tmp_path):
    rows = [e for i in range(200) for e in group(f"g{i}", [1, 0])]
    route(tmp_path / "a", rows, when=["sample"], fraction=0.25)
    route(tmp_path / "b", list(reversed(rows)), when=["sample"], fraction=0.25)
    first, second = ({i["id"] for i in items(str(tmp_path / run))} for run in ("a", "b"))
    assert first == second and 30 <= len(first) <= 70


def test_labelled_groups_train_once_with_the_scores_given(tmp_path):
    route(tmp_path, group("a", [0.0, 0.0, 1.0]) + group("b", [1.0, 0.0]) + group("c", [1.0, 1.0]), when=["always"])
    intake = ReviewIntake(str(tmp_path))
    assert intake.take(8) == (None, {"review/groups": 0.0, "review/rows": 0.0, "review/labelled_total": 0.0})
    label(str(tmp_path), "a", [1.0, None, 0.0], "scored")  # the second response keeps its reward
    label(str(tmp_path), "c", [None, None], "skip")  # skipped: never trained
    table, counts = intake.take(9)
    rows = from_table(table)
    assert [(e.trajectory_id, e.reward) for e in rows] == [("a:0", 1.0), ("a:1", 0.0), ("a:2", 0.0)]
    assert rows[0].logprobs == pytest.approx([0.0, 0.0, -0.5, -0.25])  # the rows as sampled, only rewards new
    assert counts == {"review/groups": 1.0, "review/rows": 3.0, "review/labelled_total": 1.0}
    saved = intake.state_dict()
    label(str(tmp_path), "b", [0.5, 0.5], "scored")
    restarted = ReviewIntake(str(tmp_path))
    restarted.load_state_dict(saved)
    table, counts = restarted.take(10)
    assert {e.group_id for e in from_table(table)} == {"b"} and counts["review/labelled_total"] == 2.0
    assert restarted.take(11)[0] is None


def test_unknown_rules_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"review: when=\['sometimes'\] unknown"):
        route(tmp_path, group("a", [1, 0]), when=["sometimes"])
