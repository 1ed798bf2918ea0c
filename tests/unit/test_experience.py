"""The experience record: its Arrow schema round-trips through a real shard, other schema versions
are refused, inconsistent records are caught before the buffer, and the trainer's batch takes its
masks, groups and trajectories from it."""

import pyarrow as pa
import pytest
import torch

from rft.buffer.experience import SCHEMA, Experience, check_table, from_table, to_table
from rft.buffer.shards import ExperienceBuffer
from rft.config import AlgorithmConfig
from rft.trainer.step_batch import StepBatch, batch_advantages


def two_turns(reward: float, group: str, trajectory: str, step_index: int = 0) -> Experience:
    # prompt [1, 2] | model [3, 4] | observation [5] | model [6]
    return Experience(token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[0, 0, 1, 1, 0, 1],
                      logprobs=[0.0, 0.0, -0.5, -0.25, 0.0, -1.0], prompt_length=2, reward=reward,
                      step_rewards=[0.25, 0.75], step_index=step_index, group_id=group, trajectory_id=trajectory,
                      task_id="t7", version=3, turns=2, tool_calls=1, finish_reason="env_done",
                      metrics={"success": 1.0}, response="e")


def test_a_shard_of_experience_reads_back_equal(tmp_path):
    experiences = [two_turns(1.0, "g0", "g0:0"), two_turns(0.0, "g0", "g0:1")]
    experiences[1].error, experiences[1].step_rewards = "flaky tool (retried)", None
    buffer = ExperienceBuffer(str(tmp_path))
    buffer.write(to_table(experiences), step=4, producer=1, version=3)
    claim = buffer.claim(consumer=0, timeout_s=5)
    assert claim.table.column("step").to_pylist() == [4, 4]
    assert claim.table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert claim.table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert from_table(claim.table) == experiences


def test_routed_experts_round_trip_through_a_shard_and_older_shards_read_without_them(tmp_path):
    """MoE routing replay's column: [tokens, layers, k] per row or null, read back through numpy
    from a claimed shard (whose rows are a slice of what the buffer holds); a shard written
    before the column existed reads as rows without routes."""
    import numpy as np

    rng = np.random.default_rng(0)
    experiences = [two_turns(1.0, "g0", f"g0:{i}") for i in range(3)]
    experiences[0].routed_experts = rng.integers(0, 300, size=(6, 4, 2), dtype=np.uint16)
    experiences[2].routed_experts = rng.integers(0, 8, size=(5, 4, 2), dtype=np.uint16)
    table = to_table(experiences)
    buffer = ExperienceBuffer(str(tmp_path))
    buffer.write(table.slice(1), step=1, producer=1, version=3)
    buffer.write(table, step=2, producer=1, version=3)
    for rows in ([1, 2], [0, 1, 2]):  # the shards in the order written
        read = from_table(buffer.claim(consumer=0, timeout_s=5).table)
        for got, i in zip(read, rows):
            want = experiences[i].routed_experts
            assert (got.routed_experts is None) if want is None else np.array_equal(got.routed_experts, want)
    older = from_table(table.drop_columns(["routed_experts"]))
    assert [e.routed_experts for e in older] == [None] * 3 and older[1] == experiences[1]
    mistyped = table.set_column(table.schema.get_field_index("routed_experts"), "routed_experts",
                                pa.array(["x"] * 3))  # present, it must be what the schema says
    with pytest.raises(ValueError, match="experience column 'routed_experts' has type string"):
        from_table(mistyped)


def test_another_schema_version_is_refused_with_a_message():
    table = to_table([two_turns(1.0, "g", "g:0")])
    old = table.replace_schema_metadata({b"rft.experience_schema": b"0"})
    with pytest.raises(ValueError, match="experience schema 0; this rft reads schema 1"):
        check_table(old, "shard step00000001-p001.parquet")
    with pytest.raises(ValueError, match="no rft experience schema"):
        check_table(pa.table({"reward": [1.0]}), "shard x")
    assert table.schema.equals(SCHEMA, check_metadata=True)


@pytest.mark.parametrize("change, message", [
    (dict(loss_mask=[0, 1]), "differ in length"),
    (dict(loss_mask=[1, 0, 1, 1, 0, 1]), "loss_mask is 1 inside the prompt"),
    (dict(prompt_length=9), "outside"),
    (dict(loss_mask=[0, 0, 2, 1, 0, 1]), "other than 0 and 1"),
])
def test_inconsistent_records_are_caught(change, message):
    exp = two_turns(1.0, "g", "g:0")
    for key, value in change.items():
        setattr(exp, key, value)
    with pytest.raises(ValueError, match=message):
        exp.check()


def test_unscored_experience_cannot_be_written():
    exp = two_turns(1.0, "g", "g:0")
    exp.reward = None
    with pytest.raises(ValueError, match="no reward"):
        to_table([exp])


def test_the_trainer_batch_keeps_the_mask_holes_and_names_groups():
    batch = StepBatch.from_experiences([two_turns(1.0, "b", "b:0"), two_turns(0.0, "a", "a:0"),
                                        two_turns(0.5, "b", "b:1")])
    assert batch.prompt_ids == [[1, 2]] * 3 and batch.response_ids == [[3, 4, 5, 6]] * 3
    assert batch.response_mask == [[1, 1, 0, 1]] * 3
    assert batch.old_logprobs[0] == [-0.5, -0.25, 0.0, -1.0]
    assert batch.group_ids == [0, 1, 0] and batch.trajectory_ids == [0, 1, 2]


def test_step_wise_rows_share_their_trajectory_advantage():
    # group g: trajectory A took 3 steps (reward 1), trajectory B one step (reward 0). Per-response
    # GRPO must compare A with B once each, not A three times with B once.
    rows = [two_turns(1.0, "g", "g:A", i) for i in range(3)] + [two_turns(0.0, "g", "g:B")]
    batch = StepBatch.from_experiences(rows)
    out = batch_advantages(batch, AlgorithmConfig(advantage="grpo"), None)
    a, b = 1 / (2 ** 0.5 + 1e-6), -1 / (2 ** 0.5 + 1e-6)  # (r - 0.5) / std([1, 0]) with eps
    expected = torch.tensor([[a, a, 0.0, a]] * 3 + [[b, b, 0.0, b]])
    torch.testing.assert_close(out.advantages, expected)


def test_routing_replay_batches_carry_each_rows_routes_or_name_the_missing_row():
    import numpy as np

    from rft.trainer.batches import experience_batch

    rows = [two_turns(1.0, "g0", "g0:0"), two_turns(0.0, "g0", "g0:1")]
    rows[0].routed_experts = np.full((5, 3, 2), 7, dtype=np.uint16)
    with pytest.raises(ValueError, match="trainer.routing_replay=rollout: 1 experience row") as err:
        experience_batch(to_table(rows), replay_routes=True)
    assert "trajectory g0:1" in str(err.value)
    assert experience_batch(to_table(rows))[0].expert_routes is None  # replay off: routes are not read
    rows[1].routed_experts = np.zeros((5, 3, 2), dtype=np.uint16)
    batch, _ = experience_batch(to_table(rows), replay_routes=True)
    assert [r.tolist() for r in batch.expert_routes] == [r.routed_experts.tolist() for r in rows]
