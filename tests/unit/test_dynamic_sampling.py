"""Dynamic sampling (DAPO): groups the filter rejects are dropped and the explorer generates more
until the batch is full or the rounds run out."""

from rft.algorithms.filters import SAMPLE_FILTERS
from rft.explorer.workflow import run_filtered


def _fake_generate(plan: list[list[list[float]]]):
    """generate(num_tasks, round) returning the planned groups of rewards for that round."""
    calls = []

    def generate(num_tasks: int, round_index: int) -> dict[str, list]:
        groups = plan[round_index][:num_tasks]
        calls.append(num_tasks)
        rewards = [r for g in groups for r in g]
        return {"reward": rewards, "task": [f"r{round_index}g{i}" for i, g in enumerate(groups) for _ in g]}

    return generate, calls


def test_refills_until_the_batch_is_full():
    plan = [[[1, 1], [0, 1], [0, 0]],  # round 0: only the second group has reward variance
            [[1, 0], [1, 1]],  # round 1: asked for 2 more, one kept
            [[0, 1]]]  # round 2: asked for 1 more, kept
    generate, calls = _fake_generate(plan)
    rows, stats = run_filtered(generate, SAMPLE_FILTERS.get("zero_variance"), tasks=3, group_size=2, max_rounds=5)
    assert calls == [3, 2, 1]
    assert rows["task"] == ["r0g1", "r0g1", "r1g0", "r1g0", "r2g0", "r2g0"]
    assert stats == {"rollout/groups_generated": 6.0, "rollout/groups_kept": 3.0}


def test_rounds_run_out_with_a_partial_batch_or_fall_back_to_the_first_round():
    generate, _ = _fake_generate([[[1, 0], [1, 1]], [[0, 0]]])
    rows, stats = run_filtered(generate, SAMPLE_FILTERS.get("zero_variance"), tasks=2, group_size=2, max_rounds=2)
    assert rows["task"] == ["r0g0", "r0g0"] and stats["rollout/groups_kept"] == 1.0
    generate, _ = _fake_generate([[[1, 1], [0, 0]]])
    rows, stats = run_filtered(generate, SAMPLE_FILTERS.get("zero_variance"), tasks=2, group_size=2, max_rounds=1)
    assert rows["reward"] == [1, 1, 0, 0] and stats["rollout/groups_kept"] == 2.0


def test_no_filter_generates_once():
    generate, calls = _fake_generate([[[1, 1], [0, 0]]])
    rows, _ = run_filtered(generate, SAMPLE_FILTERS.get("none"), tasks=2, group_size=2, max_rounds=3)
    assert calls == [2] and rows["reward"] == [1, 1, 0, 0]
