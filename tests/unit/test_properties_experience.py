"""Property-based tests (Hypothesis) of the experience record: any checked, scored experience
round-trips through its Arrow table and a real shard exactly (float32 token logprobs and rewards
bit for bit, edge values included); a reward that is NaN, infinite, beyond float32 or not a number
fails `check()` (the runner counts the task as failed) instead of reaching the trainer; and a
malformed table is refused with a ValueError naming the column, not misread or a pyarrow error."""

from __future__ import annotations

import math
import struct
import tempfile

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rft.buffer.experience import OPTIONAL_COLUMNS, SCHEMA, Experience, check_table, from_table, to_table
from rft.buffer.shards import ExperienceBuffer

FAST = settings(max_examples=60, deadline=None, database=None)

int32 = st.integers(-(2**31), 2**31 - 1)
float32 = st.floats(width=32, allow_nan=False)  # -0.0, subnormals and +-inf included
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
text = st.text(max_size=20)  # NUL, control characters and astral code points included


@st.composite
def experiences(draw) -> Experience:
    n = draw(st.integers(0, 12))
    prompt_length = draw(st.integers(0, n))
    mask = [0] * prompt_length + draw(st.lists(st.integers(0, 1), min_size=n - prompt_length,
                                               max_size=n - prompt_length))
    exp = Experience(
        token_ids=draw(st.lists(int32, min_size=n, max_size=n)), loss_mask=mask,
        logprobs=draw(st.lists(float32, min_size=n, max_size=n)), prompt_length=prompt_length,
        reward=draw(finite32), step_rewards=draw(st.none() | st.lists(finite32, max_size=4)),
        step_index=draw(int32), group_id=draw(text), trajectory_id=draw(text), task_id=draw(text),
        version=draw(st.integers(-(2**63), 2**63 - 1)), turns=draw(int32), tool_calls=draw(int32),
        finish_reason=draw(text), error=draw(st.none() | text),
        metrics=draw(st.dictionaries(text, st.floats(allow_nan=False), max_size=3)), response=draw(text))
    exp.check()
    return exp


def bits(values: list[float] | None) -> list[bytes] | None:
    """float32 values by their bit pattern, so -0.0 != 0.0 and every NaN payload would count."""
    return None if values is None else [struct.pack("<f", v) for v in values]


def assert_same(got: list[Experience], want: list[Experience]) -> None:
    assert got == want
    for g, w in zip(got, want):
        assert bits(g.logprobs) == bits(w.logprobs)
        assert bits([g.reward]) == bits([w.reward]) and bits(g.step_rewards) == bits(w.step_rewards)


@FAST
@given(rows=st.lists(experiences(), max_size=5))
def test_checked_experiences_round_trip_through_their_table_exactly(rows):
    table = to_table(rows)
    assert table.schema.equals(SCHEMA, check_metadata=True)
    assert_same(from_table(table), rows)


@settings(max_examples=15, deadline=None, database=None)
@given(rows=st.lists(experiences(), min_size=1, max_size=4), fmt=st.sampled_from(["parquet", "arrow"]))
def test_checked_experiences_round_trip_through_a_shard_exactly(rows, fmt):
    with tempfile.TemporaryDirectory() as root:
        buffer = ExperienceBuffer(root, fmt=fmt)
        buffer.write(to_table(rows), step=0, producer=0, version=0)
        assert_same(from_table(buffer.claim(consumer=0, timeout_s=5).table), rows)


bad_reward = st.one_of(st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                       st.floats(min_value=3.5e38, allow_infinity=False), st.floats(max_value=-3.5e38, allow_infinity=False),
                       st.text(max_size=5), st.lists(finite32, max_size=2))  # a bool is 0 or 1, as from a reward


@FAST
@given(exp=experiences(), reward=bad_reward, where=st.sampled_from(["reward", "step_rewards"]))
def test_a_nan_infinite_or_non_numeric_reward_fails_check_and_is_never_stored(exp, reward, where):
    if where == "reward":
        exp.reward = reward
    else:
        exp.step_rewards = (exp.step_rewards or []) + [reward]
    with pytest.raises(ValueError, match=where):
        exp.check()


@FAST
@given(exp=experiences(), reward=st.floats(allow_nan=True) | st.text(max_size=3) | st.booleans())
def test_whatever_passes_check_is_stored_as_a_finite_reward(exp, reward):
    exp.reward = reward
    try:
        exp.check()
    except ValueError:
        return
    stored = from_table(to_table([exp]))[0].reward
    assert math.isfinite(stored) and stored == np.float32(reward)


def table_of(exp: Experience) -> pa.Table:
    return to_table([exp, exp])


other_type = {pa.list_(pa.int32()): pa.list_(pa.int64()), pa.list_(pa.int8()): pa.list_(pa.int32()),
              pa.list_(pa.float32()): pa.list_(pa.float64()), pa.int32(): pa.int64(), pa.float32(): pa.float64(),
              pa.int64(): pa.int32(), pa.string(): pa.large_string()}


@FAST
@given(exp=experiences(), name=st.sampled_from([n for n in SCHEMA.names if n not in OPTIONAL_COLUMNS]),
       damage=st.sampled_from(["drop", "retype", "text"]))
def test_a_table_missing_or_mistyping_a_column_is_refused_naming_it(exp, name, damage):
    table = table_of(exp)
    i = table.schema.get_field_index(name)
    if damage == "drop":
        table = table.remove_column(i)
    elif damage == "retype":
        # safe=False: the column's type is the damage; a value that does not fit (a version of 2**31
        # into int32) would otherwise fail the test's own setup, not rft
        table = table.set_column(i, name, table.column(name).cast(other_type[SCHEMA.field(name).type], safe=False))
    else:
        table = table.set_column(i, name, pa.array(["x", "y"]) if name not in ("group_id", "trajectory_id", "task_id",
                                 "finish_reason", "error", "metrics", "response") else pa.array([1, 2]))
    with pytest.raises(ValueError, match=repr(name).replace("[", r"\[")):
        check_table(table, "shard s")
    with pytest.raises(ValueError, match=repr(name).replace("[", r"\[")):
        from_table(table)


@FAST
@given(exp=experiences().filter(lambda e: e.token_ids), column=st.sampled_from(["token_ids", "loss_mask", "logprobs"]),
       extra=st.integers(-3, 3).filter(bool))
def test_a_table_whose_token_columns_differ_in_length_is_refused_naming_them(exp, column, extra):
    values = getattr(exp, column)
    changed = values[:extra] if extra < 0 else values + [0] * extra
    if len(changed) == len(values):  # dropping from a shorter list than asked: nothing changed
        return
    table = table_of(exp)
    i = table.schema.get_field_index(column)
    table = table.set_column(i, SCHEMA.field(column), pa.array([values, changed], SCHEMA.field(column).type))
    with pytest.raises(ValueError, match=f"'{column}' \\({len(changed)}\\).* in row 1"):
        from_table(table)


@FAST
@given(exp=experiences(), name=st.sampled_from([f.name for f in SCHEMA if not f.nullable]))
def test_a_null_in_a_required_column_is_refused_naming_it(exp, name):
    table = table_of(exp)
    i = table.schema.get_field_index(name)
    column = pa.array([table.column(name)[0].as_py(), None], SCHEMA.field(name).type)
    table = table.set_column(i, pa.field(name, column.type), column)
    with pytest.raises(ValueError, match=f"'{name}' has 1 null"):
        from_table(table)


@FAST
@given(exp=experiences(), name=st.sampled_from(["token_ids", "loss_mask", "logprobs", "prompt_length", "reward",
                                                "step_index", "turns", "version"]),
       value=st.one_of(st.text(min_size=1, max_size=3), st.integers(2**63, 2**70), st.lists(st.text(max_size=2), min_size=1, max_size=2)))
def test_an_unstorable_field_value_is_refused_naming_the_field(exp, name, value):
    setattr(exp, name, value)
    with pytest.raises(ValueError, match=f"'{name}'"):
        to_table([exp])
