"""Experience operators (rft/buffer/operators.py): what each drops, reshapes or dedups, the counts
the pipeline logs, and a user's operator by dotted path."""

import pytest
import torch

from rft.algorithms.filters import SAMPLE_FILTERS
from rft.buffer.experience import Experience
from rft.buffer.operators import EXPERIENCE_OPERATORS, OperatorPipeline
from rft.explorer.dynamic_sampling import filter_rows


def row(group: str, sample: int, reward: float, response: str = "", sampled: int = 3, finish: str = "stop",
        metrics: dict | None = None) -> Experience:
    ids = list(range(2 + sampled))
    return Experience(token_ids=ids, loss_mask=[0, 0] + [1] * sampled, logprobs=[0.0] * len(ids), prompt_length=2,
                      reward=reward, group_id=group, trajectory_id=f"{group}:{sample}", task_id=group,
                      finish_reason=finish, response=response or f"{group} answer {sample}", metrics=metrics or {})


def names(rows: list[Experience]) -> list[str]:
    return [e.trajectory_id for e in rows]


def run(spec, rows):
    pipeline = OperatorPipeline([spec])
    return pipeline(rows), pipeline.take_scalars()


def test_reward_filter_drops_rows_outside_the_range():
    rows = [row("a", 0, -1.0), row("a", 1, 0.5), row("a", 2, 2.0)]
    kept, counts = run(("reward_filter", {"min_reward": 0.0, "max_reward": 1.0}), rows)
    assert names(kept) == ["a:1"] and counts == {"ops/reward_filter/dropped": 2.0, "ops/reward_filter/reshaped": 0.0}


def test_group_std_filter_drops_whole_groups_like_the_zero_variance_filter():
    rows = [row("a", 0, 1), row("a", 1, 1), row("b", 0, 0), row("b", 1, 1), row("c", 0, 0.5),
            row("d", 0, 0.0), row("d", 1, 0.1)]
    kept, _ = run(("group_std_filter", {}), rows)
    assert names(kept) == ["b:0", "b:1", "c:0", "d:0", "d:1"]  # c: a group of one is kept
    assert names(filter_rows(SAMPLE_FILTERS.get("zero_variance"))(rows)) == names(kept)
    kept, _ = run(("group_std_filter", {"min_std": 0.2}), rows)
    assert names(kept) == ["b:0", "b:1", "c:0"]


def test_length_filter_by_sampled_tokens_and_truncation():
    rows = [row("a", 0, 1, sampled=1), row("a", 1, 1, sampled=5), row("a", 2, 1, sampled=9),
            row("a", 3, 1, sampled=5, finish="length")]
    assert names(run(("length_filter", {"min_tokens": 2, "max_tokens": 8}), rows)[0]) == ["a:1", "a:3"]
    assert names(run(("length_filter", {"min_tokens": 2, "drop_truncated": True}), rows)[0]) == ["a:1", "a:2"]


def test_length_penalty_is_dapos_overlong_shaping():
    rows = [row("a", 0, 1.0, sampled=6), row("a", 1, 1.0, sampled=8), row("a", 2, 1.0, sampled=10),
            row("a", 3, 1.0, sampled=20)]
    kept, counts = run(("length_penalty", {"max_tokens": 10, "buffer_tokens": 4, "penalty": 1.0}), rows)
    assert [e.reward for e in kept] == [1.0, 0.5, 0.0, 0.0]
    assert counts["ops/length_penalty/reshaped"] == 3.0 and rows[1].reward == 1.0  # the input is not changed
    with pytest.raises(ValueError, match="buffer_tokens"):
        run(("length_penalty", {"max_tokens": 10, "buffer_tokens": 0}), rows)


def test_format_reward_adds_a_bonus_or_a_penalty_by_pattern():
    rows = [row("a", 0, 1.0, response="<answer>4</answer>"), row("a", 1, 0.0, response="four")]
    kept, _ = run(("format_reward", {"pattern": r"<answer>.*</answer>", "bonus": 0.2, "penalty": 0.1}), rows)
    assert [e.reward for e in kept] == pytest.approx([1.2, -0.1])
    with pytest.raises(ValueError, match="not a regular expression"):
        run(("format_reward", {"pattern": "(unclosed"}), rows)


def test_dedup_exact_and_near_within_each_group():
    rows = [row("a", 0, 1, response="The answer is 42."), row("a", 1, 1, response="the  answer is 42."),
            row("a", 2, 0, response="The answer is 42!"), row("a", 3, 0, response="I do not know at all"),
            row("b", 0, 1, response="The answer is 42.")]  # another task's: kept with scope=group
    exact, counts = run(("dedup", {}), rows)
    assert names(exact) == ["a:0", "a:2", "a:3", "b:0"] and counts["ops/dedup/dropped"] == 1.0
    near, _ = run(("dedup", {"threshold": 0.7}), rows)
    assert names(near) == ["a:0", "a:3", "b:0"]
    batch, _ = run(("dedup", {"scope": "batch"}), rows)
    assert names(batch) == ["a:0", "a:2", "a:3"]


def test_operators_run_in_order_and_count_each():
    rows = [row("a", 0, 1.0, sampled=9), row("a", 1, 0.0), row("b", 0, 1.0), row("b", 1, 1.0)]
    pipeline = OperatorPipeline([("length_penalty", {"max_tokens": 10, "buffer_tokens": 4}), ("group_std_filter", {})])
    kept = pipeline(rows)
    assert names(kept) == ["a:0", "a:1"] and kept[0].reward == pytest.approx(0.25)
    pipeline(rows)  # a second round of the same step adds up
    assert pipeline.take_scalars() == {"ops/length_penalty/dropped": 0.0, "ops/length_penalty/reshaped": 2.0,
                                       "ops/group_std_filter/dropped": 4.0, "ops/group_std_filter/reshaped": 0.0}
    assert pipeline.take_scalars() == {}


def keep_short_answers(experiences, max_chars: int = 10):
    """A user's operator, by dotted path."""
    return [e for e in experiences if len(e.response) <= max_chars]


def made_up_row(experiences):
    return experiences + [row("z", 0, 1.0)]


def nan_reward(experiences):
    for e in experiences:
        e.reward = float("nan")
    return experiences


def test_a_user_operator_by_dotted_path_and_what_it_may_not_do():
    rows = [row("a", 0, 1, response="short"), row("a", 1, 1, response="a much longer answer")]
    kept, counts = run(("tests.unit.test_experience_operators.keep_short_answers", {"max_chars": 6}), rows)
    assert names(kept) == ["a:0"] and counts["ops/keep_short_answers/dropped"] == 1.0
    with pytest.raises(ValueError, match="made_up_row returned a row it was not given"):
        run(("tests.unit.test_experience_operators.made_up_row", {}), rows)
    with pytest.raises(ValueError, match="operator nan_reward returned a row that is not valid: .*reward .* must hold finite"):
        run(("tests.unit.test_experience_operators.nan_reward", {}), rows)


def test_launch_checks_name_the_bad_entry_and_option():
    from rft.config.plugin_checks import check_operators

    check_operators("buffer.operators", ["dedup", {"name": "reward_filter", "min_reward": 0.5}], EXPERIENCE_OPERATORS)
    with pytest.raises(ValueError, match=r"buffer.operators\[1\].name"):
        check_operators("buffer.operators", ["dedup", {"name": "nope"}], EXPERIENCE_OPERATORS)
    with pytest.raises(ValueError, match=r"buffer.operators\[0\].*reward_filter takes \['min_reward', 'max_reward'\]"):
        check_operators("buffer.operators", [{"name": "reward_filter", "minimum": 0.5}], EXPERIENCE_OPERATORS)


def test_every_builtin_keeps_rows_of_a_clean_batch_typed():
    rows = [row("a", 0, 1.0, response="x"), row("a", 1, 0.0, response="y")]
    needs = {"length_penalty": {"max_tokens": 10, "buffer_tokens": 2}, "format_reward": {"pattern": "x"},
             "review": {"when": []}}
    for name in EXPERIENCE_OPERATORS.names():
        kept, _ = run((name, needs.get(name, {})), rows)
        assert all(isinstance(e, Experience) and isinstance(e.reward, float) for e in kept), name
        assert torch.tensor([e.reward for e in kept]).isfinite().all(), name
