"""Asynchronous RFT on the tiny model: the explorer runs one step ahead (`sync.offset=1`) and
weights move every second step (`sync.interval=2`), so experience is up to 2 trainer steps old;
`buffer.max_staleness=1` must keep anything older out of training (dropped) or correct it with
importance weights (re-weighted). Asserted from the version tags the shards carry on disk."""

import json

import pyarrow.parquet as pq
import pytest

from tests.e2e.helpers import launch
from tests.unit.test_schedule import simulate

STEPS, OFFSET, INTERVAL, MAX_STALENESS = 6, 1, 2, 1


def _shard_lags(buffer_dir, suffix: str) -> dict[int, int]:
    """step -> trainer steps between the weights that generated the shard and its training step
    (one producer: the trainer trains shard s at global step s)."""
    lags = {}
    for path in buffer_dir.glob(f"step*.parquet{suffix}"):
        table = pq.read_table(path)
        step, version = table.column("step")[0].as_py(), table.column("version")[0].as_py()
        assert set(table.column("version").to_pylist()) == {version}
        lags[step] = step - version
    return lags


@pytest.mark.parametrize("stale", ["drop", "reweight"])
def test_async_run_never_trains_on_experience_older_than_max_staleness(tmp_path, stale):
    result = launch("+experiment=quickstart", f"run.output_dir={tmp_path}", "stages=[]", f"trainer.max_steps={STEPS}",
                    "rollout.tasks_per_step=8", "data.eval_limit=20", f"sync.offset={OFFSET}",
                    f"sync.interval={INTERVAL}", f"buffer.max_staleness={MAX_STALENESS}", f"buffer.stale={stale}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "asynchronous: weights sync every 2 step(s), explorer 1" in " ".join(result.stdout.split())

    trained, dropped = _shard_lags(tmp_path / "buffer", ".done"), _shard_lags(tmp_path / "buffer", ".stale")
    expected = simulate(OFFSET, INTERVAL, STEPS)
    assert sorted({**trained, **dropped}.items()) == list(enumerate(expected))  # the schedule, as run
    assert max(expected) > MAX_STALENESS  # the setting does produce stale experience
    too_old = sorted(s for s, lag in enumerate(expected) if lag > MAX_STALENESS)
    summary = json.loads((tmp_path / "metrics" / "summary-rank0.json").read_text())
    trainer_log = [json.loads(line) for line in (tmp_path / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    assert [r["policy/version_lag"] for r in trainer_log] == expected
    if stale == "drop":
        assert sorted(dropped) == too_old and all(lag <= MAX_STALENESS for lag in trained.values())
        assert summary["stale_dropped"] == len(too_old) and summary["stale_reweighted"] == 0
        # a dropped step trains nothing: no loss, no optimizer step
        assert [r["step"] - 1 for r in trainer_log if "loss/policy" not in r] == too_old
    else:
        assert dropped == {} and sorted(trained) == list(range(STEPS))
        assert summary["stale_reweighted"] == len(too_old) and summary["stale_dropped"] == 0
        # truncated importance weights (trainer vs vLLM logprobs, cap 2) only on the stale steps
        weighted = [r for r in trainer_log if "actor/is_weight" in r]
        assert [r["step"] - 1 for r in weighted] == too_old
        assert all(0 < r["actor/is_weight"] <= 2.0 for r in weighted)
    evals = [json.loads(line) for line in (tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["when"] == "end" and evals[-1]["version"] == STEPS  # the last publish always goes
