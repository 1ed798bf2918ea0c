"""Priority replay (rft/buffer/replay.py) over a real buffer directory: which groups come back,
how often, in which order, and that a saved pool chooses as the live one would."""

import pytest

from rft.buffer.experience import Experience, from_table, to_table
from rft.buffer.replay import PRIORITIES, ReplayPool, replay_log
from rft.buffer.shards import ExperienceBuffer
from rft.config import ReplayConfig


def write_step(buffer: ExperienceBuffer, step: int, rewards: dict[str, list[float]], version: int | None = None):
    rows = [Experience(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, prompt_length=1, reward=r,
                       group_id=f"{step}:{g}", trajectory_id=f"{step}:{g}:{k}", task_id=g,
                       version=step if version is None else version)
            for g, rs in rewards.items() for k, r in enumerate(rs)]
    buffer.write(to_table(rows), step=step, producer=1, version=step)


def train_steps(buffer: ExperienceBuffer, pool: ReplayPool, steps: range, rewards) -> list[list[str]]:
    """Each step: write its shard, claim it, take the replay, commit (the trainer's order); the
    replayed group ids per step."""
    replayed = []
    for step in steps:
        write_step(buffer, step, rewards(step))
        claim = buffer.claim(consumer=0, timeout_s=5)
        table, _ = pool.take(step)
        replayed.append(sorted({e.group_id for e in from_table(table)}) if table is not None else [])
        buffer.commit(claim)
        pool.add(step, [(claim.name, claim.table)])
    return replayed


def test_groups_come_back_by_priority_within_their_use_limit_and_cooldown(tmp_path):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    pool = ReplayPool(buffer, ReplayConfig(groups_per_step=3, max_uses=2, cooldown=2))
    replayed = train_steps(buffer, pool, range(1, 7), lambda s: {"a": [1, 0], "b": [1, 1]})
    # newest first (age), ties by step then group id; a group used at step s waits until s + 2;
    # two uses at most (1:a at steps 2 and 4, then never again)
    assert replayed == [[], ["1:a", "1:b"], ["2:a", "2:b"], ["1:a", "3:a", "3:b"], ["2:a", "4:a", "4:b"],
                        ["3:a", "5:a", "5:b"]]
    log = replay_log(str(tmp_path))
    uses: dict[str, int] = {}
    for entry in log:
        uses[entry["group_id"]] = uses.get(entry["group_id"], 0) + 1
        assert entry["uses"] == uses[entry["group_id"]] <= 2
    by_step = {}
    for entry in log:
        by_step.setdefault(entry["step"], []).append(entry["group_id"])
    for group in uses:  # two uses of a group are at least `cooldown` steps apart
        steps = [s for s, groups in by_step.items() if group in groups]
        assert all(b - a >= 2 for a, b in zip(steps, steps[1:])), (group, steps)
    assert sum(len(v) for v in by_step.values()) == sum(len(r) for r in replayed) == len(log)


def test_the_newest_eligible_groups_are_taken_first_and_rows_are_whole_groups(tmp_path):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    pool = ReplayPool(buffer, ReplayConfig(groups_per_step=1, max_uses=1, cooldown=1))
    replayed = train_steps(buffer, pool, range(1, 5), lambda s: {"a": [1, 0, 1]})
    assert replayed == [[], ["1:a"], ["2:a"], ["3:a"]]  # age: the newest candidate each time, once each
    table, scalars = pool.take(5)
    assert [e.trajectory_id for e in from_table(table)] == ["4:a:0", "4:a:1", "4:a:2"]
    assert scalars == {"replay/groups": 1.0, "replay/rows": 3.0, "replay/candidates": 4.0}


def test_reward_std_priority_prefers_groups_that_still_teach(tmp_path):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    pool = ReplayPool(buffer, ReplayConfig(groups_per_step=1, priority="reward_std", max_uses=1))
    train_steps(buffer, pool, range(1, 2), lambda s: {"flat": [1, 1, 1, 1], "mixed": [1, 0, 0, 0], "even": [1, 0, 1, 0]})
    table, _ = pool.take(2)
    assert {e.group_id for e in from_table(table)} == {"1:even"}
    table, _ = pool.take(3)
    assert {e.group_id for e in from_table(table)} == {"1:mixed"}
    assert pool.take(4)[0] is None  # a group with equal rewards has priority 0: never replayed


def test_stale_groups_are_not_replayed_when_the_stale_policy_drops(tmp_path):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    config = ReplayConfig(groups_per_step=4, max_uses=5, cooldown=1)
    strict = ReplayPool(buffer, config, max_staleness=1, drop_stale=True)
    lenient = ReplayPool(buffer, config, max_staleness=1, drop_stale=False)
    write_step(buffer, 1, {"a": [1, 0]}, version=0)
    claim = buffer.claim(consumer=0, timeout_s=5)
    buffer.commit(claim)
    for pool in (strict, lenient):
        pool.add(1, [(claim.name, claim.table)])
    assert strict.take(2)[0] is not None  # lag 2 - 1 - 0 = 1: within max_staleness
    assert strict.take(3)[0] is None  # lag 2
    assert lenient.take(3)[0] is not None  # reweight: trained with truncated IS instead


def test_a_saved_pool_chooses_what_the_live_one_does(tmp_path):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    config = ReplayConfig(groups_per_step=2, max_uses=2, cooldown=2, capacity=5)
    pool = ReplayPool(buffer, config)
    train_steps(buffer, pool, range(1, 5), lambda s: {"a": [1, 0], "b": [0, 1], "c": [s % 2, 1]})
    assert len(pool.candidates) == 5  # capacity: the oldest left
    saved = pool.state_dict()
    resumed = ReplayPool(buffer, config)
    resumed.load_state_dict(saved)
    for step in range(5, 9):
        live, again = pool.take(step)[0], resumed.take(step)[0]
        assert (live is None and again is None) or live.equals(again), step


def test_a_consumed_shard_that_changed_is_left_out_not_trained(tmp_path, capsys):
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    pool = ReplayPool(buffer, ReplayConfig(groups_per_step=1))
    train_steps(buffer, pool, range(1, 2), lambda s: {"a": [1, 0]})
    done = next((tmp_path / "buffer").glob("*.done"))
    data = bytearray(done.read_bytes())
    data[len(data) // 2] ^= 0xFF
    done.write_bytes(bytes(data))
    table, scalars = pool.take(2)
    assert table is None and scalars["replay/candidates"] == 0.0 and pool.skipped == 1
    assert "no longer matches manifest.jsonl" in capsys.readouterr().out


def test_priorities_are_a_registry_with_a_checked_signature():
    assert PRIORITIES.names() == ["age", "reward_std"]
    with pytest.raises(ValueError, match="replay priority"):
        PRIORITIES.resolve(lambda entry: 1.0)
