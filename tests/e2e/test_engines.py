"""Several vLLM engines in one job, through the real launcher: the quickstart with two rollout
ranks (rft/explorer/dealer.py deals each step's tasks to both, each writes its own shards, the
trainer takes a step's shards from both, every sync reaches both)."""

import json
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

from rft.buffer.shards import ExperienceBuffer
from rft.launch.job_state import process_running as alive
from rft.runtime.checkpoint import newest_complete
from tests.e2e.helpers import launch, launch_until_step, leftovers, stop_launcher, tensorboard_scalars

GRPO = 8


def test_two_engines_share_every_step_and_serve_the_same_version(exported_sft_model, tmp_path):
    """With the `difficulty` selector, which chooses by the rewards it sees: each engine sees both
    engines' (rft/explorer/explorer.py), so both draw the same batch to share. From the
    quickstart's SFT'd model, so that rewards differ between tasks."""
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "cluster.rollout_ranks=2",
                    "model.tiny=null", f"model.path={exported_sft_model}",
                    f"stages=[{{name: grpo, algorithm: {{name: grpo}}, trainer: {{max_steps: {GRPO}}}, "
                    "data: {selector: {name: difficulty}}}]", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = " ".join(result.stdout.replace("│", " ").split())
    assert "engine 0: rank 1 on this machine" in plan and "engine 1: rank 2 on this machine" in plan

    shards = defaultdict(dict)  # step -> producer -> (rows, version)
    for line in (run_dir / "buffer" / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        shards[entry["step"]][entry["producer"]] = (entry["rows"], entry["version"])
    assert sorted(shards) == list(range(GRPO))
    for step, by_producer in shards.items():
        assert sorted(by_producer) == [1, 2], (step, by_producer)  # both engines wrote the step
        # both served the weights of the sync before the step (synchronous: the trainer's `step` steps)
        assert {version for _, version in by_producer.values()} == {step}, (step, by_producer)
    rows = [sum(r for r, _ in by_producer.values()) for by_producer in shards.values()]
    assert rows == [32 * 8] * GRPO  # tasks_per_step x group_size: every task once, over both engines
    # both were dealt tasks. Over the run, not in every step: the dealer is a pull (rft/explorer/dealer.py),
    # so an engine that comes late to a step is dealt less, none if the other has taken every task by
    # then (seen on an idle machine: 64 of 256 rows in a step to the slower engine, its first window)
    per_engine = {p: sum(by_producer[p][0] for by_producer in shards.values()) for p in (1, 2)}
    assert min(per_engine.values()) >= 32 * 8 // 4, per_engine
    selected = [[{k: v for k, v in row.items() if k.startswith(("step", "selector/"))}
                 for row in map(json.loads, (run_dir / "metrics" / f"rollout{rank}.jsonl").read_text().splitlines())
                 if "selector/tasks_seen" in row] for rank in (1, 2)]
    assert len(selected[0]) == GRPO and selected[0] == selected[1]  # one selector state on both engines
    assert selected[0][-1]["selector/tasks_seen"] > 32
    consumed = ExperienceBuffer(str(run_dir / "buffer")).consumed()
    assert consumed == [f"step{s:08d}-p{p:03d}.parquet" for s in range(GRPO) for p in (1, 2)]

    evals = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [(e["stage"], e["when"]) for e in evals] == [("grpo", "start"), ("grpo", "end")]  # not one per engine
    assert all(e["num_tasks"] == 200 for e in evals)
    shares = [json.loads((run_dir / "metrics" / f"summary-rank{r}.json").read_text())["eval_samples"] for r in (1, 2)]
    assert sum(shares) == 2 * 200 and min(shares) > 0, shares  # each evaluation split over both engines
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engines"] == 2
    scalars = tensorboard_scalars(str(run_dir))
    assert len(scalars["eval/accuracy"]) == 2  # engine 0 logs the shared evaluation
    assert sorted(s for s, _ in scalars["loss/policy"]) == list(range(1, GRPO + 1))


def test_a_killed_engine_fails_the_job_fast_naming_it(tmp_path):
    """Losing one of two engines ends the job at once (the default, rollout.on_engine_failure=fail),
    naming the engine, its rank and its log; the other engine goes with the job."""
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "monitor.progress=false",
                 "cluster.rollout_ranks=2", "stages.0.trainer.max_steps=20", "stages.1.trainer.max_steps=200"]
    launcher = launch_until_step(overrides, run_dir, 23)  # in GRPO: both engines are generating
    try:
        os.kill(int((run_dir / "pids" / "rank2.pid").read_text()), signal.SIGKILL)
        killed = time.time()
        out, err = launcher.communicate(timeout=120)
        took = time.time() - killed
    finally:
        stop_launcher(launcher)
    assert launcher.returncode == 1
    text = " ".join(out.split())
    assert "rank 2 failed: rollout rank 2 (engine 1) was killed by SIGKILL" in text, out[-2000:]
    assert f"log: {run_dir}/logs/" in text and "_2_log.err" in text
    assert took < 30, took  # the launcher watches the ranks' processes, not a collective's timeout
    assert "Traceback" not in out + err
    for rank in range(3):  # nothing of the job is left running
        assert not alive(int((run_dir / "pids" / f"rank{rank}.pid").read_text())), rank



def test_with_continue_the_engine_left_takes_a_lost_engines_tasks_and_the_run_finishes(tmp_path):
    """rollout.on_engine_failure=continue: engine 1 (rank 2) is killed by SIGKILL as it starts
    generating the experience of step KILL_AT, its tasks dealt (rft/runtime/faults.py: at that step
    whatever the machine's speed; a kill timed from the trainer's progress landed a step late under
    load). The run goes on: engine 0 generates the tasks engine 1 took with it and every later
    task, the weight sync reaches it without the lost engine, every step trains, the checkpoints
    after the loss are complete, and the summary says so."""
    sft, grpo, kill_at = 60, 8, 62
    run_dir = tmp_path / "run"
    # the explorer step that writes shard `kill_at` ends with `kill_at + 1` steps done (as faults count)
    env = {**os.environ, "RFT_FAULTS": f"kill_generating@{kill_at + 1}#2"}
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "cluster.rollout_ranks=2",
                    "rollout.on_engine_failure=continue", "trainer.save_interval=2",
                    f"stages.0.trainer.max_steps={sft}", f"stages.1.trainer.max_steps={grpo}", timeout=900, env=env)
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [json.loads(line)["fault"] for line in (run_dir / "faults.jsonl").read_text().splitlines()] == \
        ["kill_generating"]
    assert "engine 1 lost: rank 2 failed: rollout rank 2 (engine 1) was killed by SIGKILL" in out, out[-3000:]
    assert "engine lost: rollout rank 2 (engine 1) was killed by SIGKILL (signal 9; its memory peaked at" in out
    assert "the run finished on 1 engine(s)" in out, out[-3000:]
    assert "Traceback" not in result.stdout + result.stderr

    shards = defaultdict(dict)  # step -> producer -> (rows, version)
    for line in (run_dir / "buffer" / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        shards[entry["step"]][entry["producer"]] = (entry["rows"], entry["version"])
    assert sorted(shards) == list(range(sft, sft + grpo))  # every step has experience
    lost_at = min(step for step, by_producer in shards.items() if 2 not in by_producer)
    assert lost_at == kill_at, sorted((s, sorted(p)) for s, p in shards.items())  # died generating that step
    for step, by_producer in shards.items():
        assert sum(rows for rows, _ in by_producer.values()) == 32 * 8, (step, by_producer)  # no task lost
        assert {version for _, version in by_producer.values()} == {step}, (step, by_producer)  # synced every step
        if step >= lost_at:
            assert sorted(by_producer) == [1], (step, by_producer)  # engine 0 alone, its lost tasks included
    consumed = ExperienceBuffer(str(run_dir / "buffer")).consumed()
    assert len(consumed) == len(set(consumed)) == sum(len(p) for p in shards.values())  # each shard trained once

    scalars = tensorboard_scalars(str(run_dir))
    assert sorted(s for s, _ in scalars["loss/policy"])[-grpo:] == list(range(sft + 1, sft + grpo + 1))
    engines = dict(scalars["buffer/engines"])
    assert [engines[s + 1] for s in range(sft, sft + grpo)] == [2.0] * (lost_at - sft) + [1.0] * (sft + grpo - lost_at)
    evals = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["stage"] == "grpo" and evals[-1]["when"] == "end" and evals[-1]["num_tasks"] == 200

    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["engines_lost"]) == ["2"] and "SIGKILL" in summary["engines_lost"]["2"]
    resume = newest_complete(str(run_dir), [0, 1, 2])  # complete although rank 2 saved nothing after its loss
    assert resume is not None and resume.done == sft + grpo
    assert not (Path(resume.step_dir) / "rank2.pt").exists()
    assert json.loads((Path(resume.step_dir) / "stand_ins.json").read_text()) == {"2": 1}
    assert resume.load(2)["version"] == resume.load(1)["version"]  # a relaunched engine 1 starts as engine 0
    assert leftovers(run_dir, [0, 1, 2]) == []
