"""The per-step time split the benchmarks print (tools/bench_quickstart.step_splits), read from a
run's metrics: synchronous steps, and steps of a sync.offset run that send or load no weights."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "tools"))
from bench_quickstart import step_splits  # noqa: E402


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_step_is_split_and_a_step_without_a_sync_counts_none(tmp_path):
    (tmp_path / "metrics").mkdir()
    _write(tmp_path / "metrics" / "trainer0.jsonl", [
        {"step": 1, "stage": "grpo", "timing/step_s": 10.0, "timing/train_s": 6.0, "timing/sync_s": 1.0,
         "timing/buffer_read_s": 0.1},
        {"step": 2, "stage": "grpo", "timing/step_s": 9.0, "timing/train_s": 7.0, "timing/buffer_read_s": 0.2},
    ])
    _write(tmp_path / "metrics" / "rollout1.jsonl", [
        {"step": 1, "stage": "grpo", "timing/rollout_s": 2.0, "timing/buffer_write_s": 0.1,
         "timing/weight_apply_s": 0.5},
        {"step": 2, "stage": "grpo", "timing/rollout_s": 1.5, "timing/buffer_write_s": 0.1},
    ])
    (one, first), (two, second) = step_splits(str(tmp_path))
    assert (one, two) == (1, 2)
    assert first["sync_s"] == 1.5 and first["buffer_s"] == pytest.approx(0.2)
    assert first["other_s"] == pytest.approx(10.0 - 2.0 - 6.0 - 1.5 - 0.2)
    assert second["sync_s"] == 0.0  # sync.offset > 0: no weights sent or loaded at this step
    assert second["other_s"] == pytest.approx(9.0 - 1.5 - 7.0 - 0.3)
