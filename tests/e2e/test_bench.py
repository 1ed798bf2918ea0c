"""`mode=bench` evaluates checkpoints in one vLLM engine: the base model and the models a run left
(`bench.run_dir`: the HF exports it kept, `trainer.save_hf` with `trainer.keep_hf_exports`, then
each stage's final model), writing bench.csv / bench.md and TensorBoard scalars."""

import csv
from pathlib import Path

from tests.e2e.helpers import QUICKSTART_GRPO_STEPS, QUICKSTART_SFT_STEPS, launch, tensorboard_scalars


def test_bench_scores_the_base_model_and_a_runs_exports(quickstart_run, tmp_path):
    run_dir, bench_dir = Path(quickstart_run[0]), tmp_path / "bench"  # the run exported HF checkpoints as it went
    exports = sorted(p.name for p in (run_dir / "checkpoints" / "hf").iterdir())
    # it exported at steps SFT/2, SFT and the end; the newest 2 are kept (trainer.keep_hf_exports)
    assert exports == [f"v{QUICKSTART_SFT_STEPS:06d}", f"v{QUICKSTART_SFT_STEPS + QUICKSTART_GRPO_STEPS:06d}"]

    result = launch("+experiment=quickstart", "mode=bench", f"run.output_dir={bench_dir}",
                    f"bench.checkpoints=[{run_dir}/initial_model]", f"bench.run_dir={run_dir}", "bench.k=[1,4]")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = list(csv.DictReader((bench_dir / "bench.csv").open()))
    assert [r["checkpoint"] for r in rows] == [str(run_dir / "initial_model")] + [
        str(run_dir / "checkpoints" / "hf" / name) for name in exports] + [str(run_dir / "models" / s) for s in ("sft", "grpo")]
    for row in rows:
        p1, p4, m4 = float(row["pass@1"]), float(row["pass@4"]), float(row["mean@4"])
        assert 0.0 <= p1 <= p4 <= 1.0 and 0.0 <= m4 <= 1.0 and int(row["tasks"]) == 200
    # the exports' weights were really served: the SFT'd model solves what the random one cannot
    assert float(rows[0]["pass@4"]) == 0.0 and float(rows[-1]["pass@4"]) > 0.0
    assert "| checkpoint |" in (bench_dir / "bench.md").read_text()
    scalars = tensorboard_scalars(str(bench_dir))
    assert sorted(s for s, _ in scalars["bench/pass@4"]) == list(range(len(rows)))
