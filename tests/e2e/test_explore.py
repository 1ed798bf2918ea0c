"""`mode=explore`: rollout ranks only, no trainer; the experience stays in the buffer, tagged with
the version of the weights that produced it, for a trainer elsewhere."""

import json

from rft.buffer.shards import ExperienceBuffer
from tests.e2e.helpers import launch

STEPS = 3


def test_explore_writes_experience_without_a_trainer(tmp_path):
    result = launch("+experiment=quickstart", "mode=explore", f"run.output_dir={tmp_path}", "stages=[]",
                    f"trainer.max_steps={STEPS}", "rollout.tasks_per_step=8", "data.eval_limit=20")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(1 tasks)" in result.stdout
    buffer = ExperienceBuffer(str(tmp_path / "buffer"))
    assert buffer.pending() == [f"step{s:08d}-p000.parquet" for s in range(STEPS)]  # nobody consumed them
    claim = buffer.claim(consumer=0, timeout_s=1)
    assert claim.table.num_rows == 8 * 8 and set(claim.table.column("version").to_pylist()) == {0}
    evals = [json.loads(line) for line in (tmp_path / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [e["when"] for e in evals] == ["start", "end"] and all(e["num_tasks"] == 20 for e in evals)
