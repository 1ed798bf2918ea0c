"""Several vLLM engines in one job, through the real launcher: the quickstart with two rollout
ranks (rft/explorer/dealer.py deals each step's tasks to both, each writes its own shards, the
trainer takes a step's shards from both, every sync reaches both)."""

import json
from collections import defaultdict

from rft.buffer.shards import ExperienceBuffer
from tests.e2e.helpers import launch, tensorboard_scalars

SFT, GRPO = 300, 8


def test_two_engines_share_every_step_and_serve_the_same_version(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "cluster.rollout_ranks=2",
                    f"stages.0.trainer.max_steps={SFT}", f"stages.1.trainer.max_steps={GRPO}", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = " ".join(result.stdout.replace("│", " ").split())
    assert "engine 0: rank 1 on this machine" in plan and "engine 1: rank 2 on this machine" in plan

    shards = defaultdict(dict)  # step -> producer -> (rows, version)
    for line in (run_dir / "buffer" / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        shards[entry["step"]][entry["producer"]] = (entry["rows"], entry["version"])
    assert sorted(shards) == list(range(SFT, SFT + GRPO))
    for step, by_producer in shards.items():
        assert sorted(by_producer) == [1, 2], (step, by_producer)  # both engines wrote the step
        assert all(rows > 0 for rows, _ in by_producer.values()), (step, by_producer)  # both were dealt tasks
        # both served the weights of the sync before the step (synchronous: the trainer's `step` steps)
        assert {version for _, version in by_producer.values()} == {step}, (step, by_producer)
    rows = [sum(r for r, _ in by_producer.values()) for by_producer in shards.values()]
    assert rows == [32 * 8] * GRPO  # tasks_per_step x group_size: every task once, over both engines
    consumed = ExperienceBuffer(str(run_dir / "buffer")).consumed()
    assert consumed == [f"step{s:08d}-p{p:03d}.parquet" for s in range(SFT, SFT + GRPO) for p in (1, 2)]

    evals = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["when"]) for e in evals] == [("sft", "start"), ("sft", "end"), ("grpo", "start"),
                                                        ("grpo", "end")]  # one line each, not one per engine
    assert all(e["num_tasks"] == 200 for e in evals)
    shares = [json.loads((run_dir / "metrics" / f"summary-rank{r}.json").read_text())["eval_samples"] for r in (1, 2)]
    assert sum(shares) == 4 * 200 and min(shares) > 0, shares  # each evaluation split over both engines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engines"] == 2
    scalars = tensorboard_scalars(str(run_dir))
    assert len(scalars["eval/accuracy"]) == 4  # engine 0 logs the shared evaluation
    assert sorted(s for s, _ in scalars["loss/policy"])[-GRPO:] == list(range(SFT + 1, SFT + GRPO + 1))
