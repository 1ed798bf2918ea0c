"""cluster.colocate=true on the quickstart: GRPO from the SFT warm-up, swept with the disjoint run
(`-m cluster.colocate=false,true`). The colocated run learns as the disjoint one does (the same
thresholds as the quickstart test, and on CPU step for step the same losses and accuracy), and its
phase journals show the turns: every train step starts after the engine went to sleep for it, the
engine loads each version after the trainer started publishing it, and wakes its KV cache only
once the weights are in. On CPU vLLM's sleep frees nothing, so a sleep that never reached vLLM
would pass all of that: the journal also holds what vLLM said after each call (asleep, at the
configured rollout.sleep_level; awake), and the run sets level 2, not the default, so that the
configured level is seen to arrive."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.e2e.helpers import REPO

STEPS = 20


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "metrics" / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_colocated_grpo_learns_as_the_disjoint_run_and_takes_turns(exported_sft_model, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=local", "monitor.progress=false",
         "model.tiny=null", f"model.path={exported_sft_model}", "cluster.colocate=false,true", "rollout.sleep_level=2",
         "stages=[{name: grpo, algorithm: {name: grpo, lr: 3.0e-4, clip_eps: 0.2}, trainer: {max_steps: %d}}]" % STEPS,
         f"hydra.sweep.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    disjoint, colocated = tmp_path / "0", tmp_path / "1"
    out = " ".join(result.stdout.replace("│", " ").split())
    assert "colocated ranks 0+1 share their devices (vLLM's sleep frees nothing on CPU), taking turns: vLLM sleeps " \
           "(level 2) while the trainer trains" in out
    assert "engine checkpoint (colocated)" in out and "turn wait" in out and "sleep" in out

    # it learns: the quickstart test's thresholds, and the disjoint run's every number
    evals = {run: [row for row in _rows(run, "eval.jsonl")] for run in (disjoint, colocated)}
    start, end = evals[colocated][0]["accuracy"], evals[colocated][-1]["accuracy"]
    assert start >= 0.15 and end >= start + 0.05, (start, end)
    assert [e["accuracy"] for e in evals[colocated]] == [e["accuracy"] for e in evals[disjoint]]
    losses = {run: [row["loss/policy"] for row in _rows(run, "trainer0.jsonl") if "loss/policy" in row]
              for run in (disjoint, colocated)}
    assert len(losses[colocated]) == STEPS and all(math.isfinite(v) for v in losses[colocated])
    assert losses[colocated] == losses[disjoint]
    assert not (disjoint / "metrics" / "phases0.jsonl").exists()  # the disjoint run takes no turns

    # the turns, from both ranks' phase journals
    trainer = {(p["phase"], p["step"]): p for p in _rows(colocated, "phases0.jsonl")}
    engine = _rows(colocated, "phases1.jsonl")
    slept = {p["step"]: p for p in engine if p["phase"] == "sleep"}
    for step in range(1, STEPS + 1):
        train = trainer[("train", step)]
        assert slept[step]["end"] <= train["start"], step  # the GPU was the trainer's
        # vLLM itself said it was asleep after the call, which was made at the configured level
        assert (slept[step]["level"], slept[step]["vllm_levels"]) == (2, [2]), slept[step]
    loads = {p["step"]: p for p in engine if p["phase"] == "load"}
    published = [step for (phase, step) in trainer if phase == "publish"]
    assert sorted(loads) == sorted(published) and published  # every version sent was loaded
    for version, load in loads.items():
        assert trainer[("publish", version)]["start"] <= load["end"]
        woken = next(p for p in engine if p["phase"] == "wake_kv_cache" and p["step"] == version)
        assert load["end"] <= woken["start"]  # the KV cache wakes once the new weights are in
    woke = [p for p in engine if p["phase"] in ("wake", "wake_kv_cache")]
    assert woke and all(p["vllm_awake"] for p in woke), woke  # vLLM said it was fully awake again
    # with its weights woken and its KV cache not yet, vLLM said it was still asleep in part
    partly = [p for p in engine if p["phase"] == "wake_weights"]
    assert len(partly) == len(loads) and not any(p["vllm_awake"] for p in partly), partly
    served = [row["version"] for row in evals[colocated]]
    assert served[-1] == STEPS  # the end eval ran on the last version
