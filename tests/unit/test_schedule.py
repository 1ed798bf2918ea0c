"""The trainer/explorer step schedule (rft/runtime/schedule.py), run as two simulated processes that block
the way the real ones do: the trainer waits for its shard, both sides meet at every vote and every
weight transfer. Checks that no setting deadlocks, every vote and publish pairs up, and the
staleness each shard gets."""

from types import SimpleNamespace

import pytest

from rft.runtime.schedule import max_lag, paired_trainer_steps, publishes_after


def config(offset: int, interval: int, steps: int, policy_loss: str = "ppo", eval_interval: int = 0):
    cfg = SimpleNamespace(mode="both", sync=SimpleNamespace(offset=offset, interval=interval),
                          monitor=SimpleNamespace(eval_interval=eval_interval))
    stage = SimpleNamespace(trainer=SimpleNamespace(max_steps=steps),
                            algorithm=SimpleNamespace(policy_loss=policy_loss))
    return cfg, stage


def _explorer(cfg, stage, start):
    for e in range(stage.trainer.max_steps):
        yield ("write", e)
        for t in paired_trainer_steps(cfg, stage, e):
            yield ("vote", t)
            if publishes_after(cfg, stage, start, t):
                yield ("xfer", t)


def _trainer(cfg, stage, start):
    for t in range(stage.trainer.max_steps):
        yield ("claim", t)
        yield ("vote", t)
        if publishes_after(cfg, stage, start, t):
            yield ("xfer", t)


def simulate(offset: int, interval: int, steps: int, start: int = 0) -> list[int]:
    """Run both roles of one rollout stage to the end; returns each shard's lag when trained
    (trainer steps since the weights that generated it). Fails on a deadlock."""
    cfg, stage = config(offset, interval, steps)
    explorer, trainer = _explorer(cfg, stage, start), _trainer(cfg, stage, start)
    ex, tr = next(explorer), next(trainer)
    version, written, lags = start, {}, []
    while ex is not None or tr is not None:
        moved = False
        if ex is not None and ex[0] == "write":
            written[ex[1]] = version
            ex, moved = next(explorer, None), True
        if tr is not None and tr[0] == "claim" and tr[1] in written:
            lags.append(start + tr[1] - written[tr[1]])
            tr, moved = next(trainer, None), True
        if ex is not None and ex == tr:  # a rendezvous: vote or weight transfer
            if ex[0] == "xfer":
                version = start + ex[1] + 1  # the trainer's global steps done when it sent them
            ex, tr, moved = next(explorer, None), next(trainer, None), True
        assert moved, f"deadlock: explorer at {ex}, trainer at {tr} (offset={offset}, interval={interval})"
    return lags


@pytest.mark.parametrize("offset", [0, 1, 2, 5])
@pytest.mark.parametrize("interval", [1, 2, 3])
@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_no_setting_deadlocks_and_staleness_stays_within_offset_plus_interval(offset, interval, steps):
    lags = simulate(offset, interval, steps, start=10)
    assert len(lags) == steps
    assert max(lags) <= max_lag(config(offset, interval, steps)[0])
    assert lags[0] == 0  # the first shard of a stage uses the previous stage's final weights


def test_synchronous_is_on_policy_and_one_step_off_is_one_behind():
    assert simulate(0, 1, 6) == [0] * 6
    assert simulate(1, 1, 6) == [0, 1, 1, 1, 1, 1]


def test_interval_and_offset_reach_their_bound():
    # sync every 2 steps, explorer 1 ahead: shard e waits for the publish of step e - 2
    assert simulate(1, 2, 8) == [0, 1, 2, 1, 2, 1, 2, 1]
    assert simulate(0, 3, 7) == [0, 1, 2, 0, 1, 2, 0]


def test_every_trainer_vote_meets_exactly_one_explorer_vote():
    for offset in range(4):
        for steps in range(1, 6):
            cfg, stage = config(offset, 1, steps)
            paired = [t for e in range(steps) for t in paired_trainer_steps(cfg, stage, e)]
            assert paired == list(range(steps))


def test_last_publish_always_goes_and_unused_ones_are_skipped():
    cfg, stage = config(offset=2, interval=1, steps=5)
    # weights of steps 2 and 3 would arrive after the explorer's last generation: not sent
    assert [t for t in range(5) if publishes_after(cfg, stage, 0, t)] == [0, 1, 4]


def test_dataset_stages_ignore_offset_and_interval():
    cfg, stage = config(offset=3, interval=4, steps=6, policy_loss="sft", eval_interval=2)
    assert [t for t in range(6) if publishes_after(cfg, stage, 10, t)] == [1, 3, 5]  # evals at 12, 14; end
    assert [paired_trainer_steps(cfg, stage, e) for e in range(6)] == [[e] for e in range(6)]
