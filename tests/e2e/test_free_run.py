"""sync.free_run=true on the quickstart: GRPO from the SFT warm-up with the explorer running free of
the trainer's steps, stopped a third of the way by the time-limit signal, launched again, stopped
and killed in the middle of a step at two thirds, and launched again to its end.

The explorer runs ahead (shards trained a step or two after the weights that generated them), never
past buffer.max_staleness (no shard is dropped as stale), and the run learns with the quickstart
test's thresholds. The stop: the trainer saves at its step, the explorer adds its file to that
checkpoint from wherever it is (ahead), and the launch stops. The kill: the shards the explorer
wrote after its own checkpoint are set aside, and the resumed explorer takes what it had sampled
for them back from its generation journal instead of sampling again; in the step the kill cut,
what had finished is taken back, and what the stop signal found in flight goes on from the tokens
it had. Every step's experience is trained exactly once.

With rollout.partial_rollout as well, the weights reach the engines in the middle of their
generations: samples cut by an update go on with the new weights, each token labelled with the
version that sampled it, a sample's version (what its staleness counts from) its oldest token's."""

import json
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq

from rft.buffer.shards import ExperienceBuffer
from rft.runtime.checkpoint import newest_complete
from tests.e2e.helpers import launch, launch_until_step

STEPS, LEAD, SAVE_EVERY = 20, 2, 4
STAGE = f"stages=[{{name: grpo, algorithm: {{name: grpo, lr: 3.0e-4, clip_eps: 0.2}}, trainer: {{max_steps: {STEPS}}}}}]"


def _overrides(run_dir: Path, model: str) -> list[str]:
    return ["+experiment=quickstart", "cluster=local", f"run.output_dir={run_dir}", "model.tiny=null",
            f"model.path={model}", "sync.free_run=true", f"buffer.max_staleness={LEAD}", STAGE]


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / name).read_text().splitlines()]


def test_a_free_running_grpo_run_stays_within_its_staleness_learns_and_resumes_exactly_once(exported_sft_model, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*_overrides(run_dir, exported_sft_model), f"trainer.save_interval={SAVE_EVERY}"]
    launcher = launch_until_step([*overrides, "monitor.progress=false"], run_dir, STEPS // 3)
    for pid_file in (run_dir / "pids").glob("rank*.pid"):  # what Slurm sends every task before the limit
        os.kill(int(pid_file.read_text()), signal.SIGUSR2)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode != 0 and "launch again with run.output_dir=" in out + err, out[-3000:] + err[-3000:]
    stopped_at = max(int(p.name[4:]) for p in (run_dir / "checkpoints").glob("step*"))
    assert STEPS // 3 <= stopped_at < STEPS
    saved = newest_complete(str(run_dir), [0, 1])
    explorer_at = saved.load(1)["progress"]["global_step"]  # the explorer's file: where it was, ahead
    assert saved.done == stopped_at and stopped_at <= explorer_at <= stopped_at + LEAD + 1, (stopped_at, explorer_at)

    # launched again, the stop signal reaches the explorer in the middle of step CUT, and Slurm's
    # kill follows once it recorded its requests in flight (rft/runtime/faults.py acts both out)
    cut = 2 * STEPS // 3
    faults = {**os.environ, "RFT_FAULTS": f"usr2_generating@{cut}#1,kill_in_flight@{cut}#1"}
    killed = launch(*overrides, env=faults)
    assert killed.returncode != 0 and "rollout rank 1 was killed by SIGKILL" in killed.stdout + killed.stderr
    saved = newest_complete(str(run_dir), [0, 1])
    explorer_at = saved.load(1)["progress"]["global_step"]
    journal = [json.loads(line) for line in (run_dir / "inflight" / "rank1" / f"step{cut:08d}.jsonl").open()]
    kept = [c for line in journal for c in line["completions"] if c["finish_reason"] == "abort"]
    finished = sum(len(line["completions"]) for line in journal if line["completions"][0]["finish_reason"] != "abort")
    assert kept, "the stop came after the step's requests finished"
    generated = {n.split(".")[0] for n in os.listdir(run_dir / "buffer") if n.startswith("step")
                 and int(n[4:12]) >= explorer_at}  # written after the explorer's checkpoint: set aside on resume
    lost_attempt = {name: pq.read_table(next((run_dir / "buffer").glob(f"{name}*"))) for name in generated}

    result = launch(*overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_log.out"))
    assert f"checkpoints/step{stopped_at:08d} ({stopped_at} steps done)" in logs
    assert f"checkpoints/step{saved.done:08d} ({saved.done} steps done)" in logs
    # what the killed attempt finished after the explorer's checkpoint is taken back from its generation
    # journal, not drawn again (drawn again, it would come from the newer weights the resumed run holds)
    for name, table in lost_attempt.items():
        again = pq.read_table(run_dir / "buffer" / f"{name}.parquet.done")
        for column in ("token_ids", "logprobs", "token_versions", "version"):
            assert again.column(column).to_pylist() == table.column(column).to_pylist(), (name, column)
    rollout = {r["step"]: r for r in _rows(run_dir, "rollout1.jsonl")}
    assert rollout[cut].get("rollout/replayed_samples", 0) >= finished
    assert rollout[cut]["rollout/resumed_samples"] == len(kept)
    # and each sample the stop caught in flight went on from the tokens it had, labelled with their version
    table = pq.read_table(run_dir / "buffer" / f"step{cut - 1:08d}-p001.parquet.done")
    rows = list(zip(*(table.column(c).to_pylist() for c in ("token_ids", "prompt_length", "token_versions"))))
    for sample in kept:
        k = len(sample["token_ids"])
        match = [(ids, start, versions) for ids, start, versions in rows if ids[start:start + k] == sample["token_ids"]]
        assert match, sample["token_ids"]
        assert any(versions[start:start + k] == sample["versions"] for _, start, versions in match)
    assert not (run_dir / "inflight" / "rank1").exists()  # a finished run leaves no journal

    # every step's experience trained once, none left, each step logged once by the trainer
    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    assert buffer.consumed() == [f"step{s:08d}-p001.parquet" for s in range(STEPS)]
    assert buffer.pending() == []
    trainer = _rows(run_dir, "trainer0.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))

    # ahead of the trainer, within the bound: nothing dropped as stale
    lags = [r["policy/version_lag"] for r in trainer]
    assert max(lags) <= LEAD and max(lags) >= 1, lags
    assert trainer[-1]["buffer/stale_dropped"] == 0
    versions = {}
    for line in (run_dir / "buffer" / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        versions[entry["step"]] = entry["version"]
    assert all(0 <= shard - version <= LEAD for shard, version in versions.items()), versions

    # it learns: the quickstart test's thresholds
    evals = _rows(run_dir, "eval.jsonl")
    start, end = evals[0]["accuracy"], evals[-1]["accuracy"]
    assert start >= 0.15 and end >= start + 0.05, (start, end)
    assert evals[-1]["version"] == STEPS  # the end eval ran on the last weights


def test_with_partial_rollout_updates_cut_generations_which_go_on_with_each_tokens_version_kept(
        exported_sft_model, tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*_overrides(run_dir, exported_sft_model), "rollout.partial_rollout=true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    assert buffer.consumed() == [f"step{s:08d}-p001.parquet" for s in range(STEPS)]
    continued = sum(r.get("rollout/continued_samples", 0) for r in _rows(run_dir, "rollout1.jsonl"))
    assert continued > 0  # updates came while the engine generated (on 2 cores: in 7 of 20 steps)

    mixed = 0
    for shard in range(STEPS):
        table = pq.read_table(run_dir / "buffer" / f"step{shard:08d}-p001.parquet.done")
        for versions, mask, version in zip(*(table.column(c).to_pylist() for c in ("token_versions", "loss_mask",
                                                                                     "version"))):
            sampled = [v for v, m in zip(versions, mask) if m]
            assert sampled == sorted(sampled) and min(sampled) == version  # oldest first; counted from it
            assert 0 <= shard - version <= LEAD and max(sampled) <= shard  # within the bound, never ahead
            mixed += len(set(sampled)) > 1
    assert mixed > 0
    evals = _rows(run_dir, "eval.jsonl")
    start, end = evals[0]["accuracy"], evals[-1]["accuracy"]
    assert start >= 0.15 and end >= start + 0.05, (start, end)
