"""rollout.on_engine_failure=restart (rft/explorer/engine_restart.py): GRPO from the quickstart's
SFT warm-up, the vLLM engine core killed twice (SIGKILL, as a GPU's Xid error would) and stopped once
(SIGSTOP, a hang its stall watch must notice), each once a request of the step was answered
(rft/runtime/faults.py: at that step whatever the machine's speed). The run finishes; no step's
experience is lost or trained twice; the answered requests come back from the generation journal;
the weights a restarted engine serves are the ones it served; the summary counts 3 restarts; and
the run ends where an uninterrupted one does."""

import json
import os
import sys

from tests.e2e.helpers import REPO, launch

sys.path.insert(0, os.path.join(REPO, "tools"))
from chaos import check_run  # noqa: E402

from rft.runtime.storage import read_jsonl  # noqa: E402

GRPO, FAULTS = 8, {2: "kill_engine", 4: "kill_engine", 6: "stop_engine"}
STALL_S = 10  # rollout.engine_stall_s: the stopped engine answers nothing for this long, then is killed


# vLLM runs a step's 256 requests in waves of this many: the first answer comes while later waves
# wait, so each fault strikes with requests in flight (all 256 at once often finished in the same
# engine step, and a fault after the last answer leaves nothing to take from the journal: that
# case is tests/dist/test_engine_lost_after_batch.py's)
WAVE = 64


def _grpo(model: str, run_dir, *extra: str, env: dict | None = None):
    return launch("+experiment=quickstart", "model.tiny=null", f"model.path={model}", f"run.output_dir={run_dir}",
                  f"stages=[{{name: grpo, algorithm: {{name: grpo}}, trainer: {{max_steps: {GRPO}}}}}]",
                  f"rollout.max_num_seqs={WAVE}", *extra, timeout=900, env=env)


def test_an_engine_killed_twice_and_stopped_once_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
        exported_sft_model, tmp_path):
    reference = _grpo(exported_sft_model, tmp_path / "reference")
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    run_dir = tmp_path / "run"
    env = {**os.environ, "RFT_FAULTS": ",".join(f"{kind}@{step}" for step, kind in FAULTS.items())}
    result = _grpo(exported_sft_model, run_dir, "rollout.on_engine_failure=restart",
                   f"rollout.engine_stall_s={STALL_S}", env=env)
    out = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    struck = [(row["fault"], row["step"]) for row in read_jsonl(run_dir / "faults.jsonl")]
    assert struck == [(kind, step) for step, kind in FAULTS.items()]
    assert "engine restarts: 3 (rollout.on_engine_failure=restart)" in out, out[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["engine_restarts"] == 3
    assert "Traceback" not in result.stdout + result.stderr

    log = "".join(p.read_text() for p in (run_dir / "logs").glob("*_1_log.out"))
    assert log.count("rft: engine 0 died (EngineDeadError") == 2, log[-3000:]
    assert log.count("rft: engine 0 stalled: ") == 1 and log.count("rft: engine 0 stalled (EngineDeadError") == 1
    # each restart loaded the weights of the sync before its step (the step writing shard s serves
    # version s, the trainer's after s steps): kept by the engine as they arrived
    for step in FAULTS:
        assert f"serving version {step - 1} (weights kept at its last sync)" in log, (step, log[-3000:])

    # every step's experience trained exactly once, every trainer step logged once (tools/chaos.py's checks)
    assert check_run(str(run_dir), GRPO, sft_steps=0, producer=1) == {
        "experience_lost": 0, "experience_extra": 0, "metric_gaps": 0}
    manifest = list(read_jsonl(run_dir / "buffer" / "manifest.jsonl"))
    assert [(e["step"], e["rows"], e["version"]) for e in manifest] == [(s, 32 * 8, s) for s in range(GRPO)]
    # the requests answered before each fault came back from the journal, not sampled again
    replayed = {}
    for row in read_jsonl(run_dir / "metrics" / "rollout1.jsonl"):
        replayed[row["step"]] = replayed.get(row["step"], 0) + row.get("rollout/replayed_samples", 0)
    assert all(replayed.get(step, 0) > 0 for step in FAULTS), replayed

    # the run ends where the uninterrupted one does: its held-out accuracy within noise of it (two
    # draws of the same 8 steps; the quickstart's test asks +5 points of a GRPO stage)
    ends = [[e["accuracy"] for e in read_jsonl(d / "metrics" / "eval.jsonl") if e["when"] == "end"][0]
            for d in (tmp_path / "reference", run_dir)]
    assert abs(ends[0] - ends[1]) <= 0.05, ends
