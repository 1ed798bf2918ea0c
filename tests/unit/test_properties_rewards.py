"""Property-based tests (Hypothesis) of RewardScorer: a reward that returns NaN, an infinity, None,
a non-numeric string, a container or (batch form) the wrong number of values scores 0.0 and is
counted as an error, and scoring goes on; a finite number passes through unchanged. The rewards
run in a forked child, so one scorer per form serves every example (the value to return travels
in the task's row) and the example counts stay small."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rft.buffer.experience import Experience
from rft.data.taskset import Task
from rft.explorer.rewards import RewardScorer

FEW = settings(max_examples=25, deadline=None, database=None)
SAMPLE = Experience(token_ids=[], loss_mask=[], logprobs=[], prompt_length=0, response="r")


def returns_the_rows_value(trajectory, task):
    return task.row["value"]


def returns_the_rows_values(trajectories, tasks):
    return tasks[0].row["value"]


@pytest.fixture(scope="module")
def one():
    with RewardScorer(returns_the_rows_value, timeout_s=10) as scorer:
        yield scorer


@pytest.fixture(scope="module")
def batch():
    with RewardScorer(returns_the_rows_values, timeout_s=10) as scorer:
        yield scorer


def task(value) -> Task:
    return Task(0, "q", "a", row={"value": value})


# Strings are not rewards, numeric ones ("0.5", "nan") included; nor is a finite number beyond
# float32's range, which the shard would store as inf.
not_a_number = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, None, "nan", "inf", "-Infinity", "0.5", 1e39, -1e39]),
    st.text(max_size=6), st.floats(min_value=3.5e38, allow_infinity=False),
    st.lists(st.floats(-1, 1), max_size=2), st.dictionaries(st.text(max_size=2), st.floats(-1, 1), max_size=2))


@FEW
@given(value=not_a_number)
def test_a_reward_that_is_not_a_finite_number_scores_zero_and_is_counted(one, value):
    errors = one.errors
    assert one.score([SAMPLE, SAMPLE], [task(value), task(0.75)]) == [0.0, 0.75]  # scoring goes on
    assert one.errors == errors + 1


@FEW
@given(value=st.floats(-3.4e38, 3.4e38) | st.integers(-10**6, 10**6) | st.booleans())
def test_a_finite_reward_passes_through_unchanged(one, value):
    errors = one.errors
    assert one.score([SAMPLE], [task(value)]) == [float(value)]
    assert one.errors == errors


@FEW
@given(n=st.integers(1, 4), data=st.data())
def test_a_batch_reward_of_the_wrong_length_or_type_scores_its_batch_zero_and_counts_each(batch, n, data):
    wrong_length = st.integers(0, 6).filter(lambda k: k != n).flatmap(
        lambda k: st.lists(st.floats(-1, 1), min_size=k, max_size=k))
    values = data.draw(wrong_length | not_a_number.filter(lambda v: not isinstance(v, (list, dict))))
    errors = batch.errors
    assert batch.score([SAMPLE] * n, [task(values)] * n) == [0.0] * n
    assert batch.errors == errors + n
    assert batch.score([SAMPLE] * n, [task([0.5] * n)] * n) == [0.5] * n  # the next batch is scored
