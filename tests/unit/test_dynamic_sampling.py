"""Dynamic sampling (DAPO): groups the filter rejects are dropped and the explorer generates more
until the batch is full or the rounds run out."""

from rft.algorithms.filters import SAMPLE_FILTERS
from rft.buffer.experience import Experience
from rft.explorer.dynamic_sampling import filter_rows, run_filtered


def _fake_generate(plan: list[list[list[float]]]):
    """generate(num_tasks, round) returning the planned groups of rewards for that round."""
    calls = []

    def generate(num_tasks: int, round_index: int) -> list[Experience]:
        groups = plan[round_index][:num_tasks]
        calls.append(num_tasks)
        return [Experience([], [], [], 0, reward=r, group_id=f"r{round_index}g{i}")
                for i, g in enumerate(groups) for r in g]

    return generate, calls


def groups(experiences: list[Experience]) -> list[str]:
    return [e.group_id for e in experiences]


def test_refills_until_the_batch_is_full():
    plan = [[[1, 1], [0, 1], [0, 0]],  # round 0: only the second group has reward variance
            [[1, 0], [1, 1]],  # round 1: asked for 2 more, one kept
            [[0, 1]]]  # round 2: asked for 1 more, kept
    generate, calls = _fake_generate(plan)
    kept, stats = run_filtered(generate, filter_rows(SAMPLE_FILTERS.get("zero_variance")), tasks=3, max_rounds=5)
    assert calls == [3, 2, 1]
    assert groups(kept) == ["r0g1", "r0g1", "r1g0", "r1g0", "r2g0", "r2g0"]
    assert stats == {"rollout/groups_generated": 6.0, "rollout/groups_kept": 3.0}


def test_rounds_run_out_with_a_partial_batch_or_fall_back_to_the_first_round():
    generate, _ = _fake_generate([[[1, 0], [1, 1]], [[0, 0]]])
    kept, stats = run_filtered(generate, filter_rows(SAMPLE_FILTERS.get("zero_variance")), tasks=2, max_rounds=2)
    assert groups(kept) == ["r0g0", "r0g0"] and stats["rollout/groups_kept"] == 1.0
    generate, _ = _fake_generate([[[1, 1], [0, 0]]])
    kept, stats = run_filtered(generate, filter_rows(SAMPLE_FILTERS.get("zero_variance")), tasks=2, max_rounds=1)
    assert [e.reward for e in kept] == [1, 1, 0, 0] and stats["rollout/groups_kept"] == 2.0


def test_ragged_groups_count_as_groups():
    # a group that lost a sample (3 of 4) is still one group; a task whose samples all failed is none
    generate, calls = _fake_generate([[[1, 0, 1], [], [0, 1, 1, 1]], [[1, 0]]])
    kept, stats = run_filtered(generate, filter_rows(SAMPLE_FILTERS.get("zero_variance")), tasks=3, max_rounds=2)
    assert calls == [3, 1] and stats["rollout/groups_kept"] == 3.0
    assert groups(kept) == ["r0g0"] * 3 + ["r0g2"] * 4 + ["r1g0"] * 2


def test_no_filter_generates_once():
    generate, calls = _fake_generate([[[1, 1], [0, 0]]])
    kept, _ = run_filtered(generate, filter_rows(SAMPLE_FILTERS.get("none")), tasks=2, max_rounds=3)
    assert calls == [2] and [e.reward for e in kept] == [1, 1, 0, 0]
