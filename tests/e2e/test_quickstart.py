"""A shortened quickstart (same model, data and stages, fewer steps) must still learn, judged from
its TensorBoard event files; and every scalar the monitor promises is there. GRPO with LoRA
adapters (synced to vLLM as adapters) from the same SFT warm-up must learn too: the run leaves its
SFT'd model, so that run needs no warm-up of its own; its last checkpoint, adapters and all,
converts (`python -m rft.export`) to the model the stage's end wrote."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.helpers import QUICKSTART_GRPO_STEPS, QUICKSTART_SFT_STEPS, REPO, launch, tensorboard_scalars

REQUIRED_SCALARS = [
    "reward/mean", "reward/std", "response_length/mean", "loss/policy", "loss/kl", "actor/entropy",
    "actor/clipfrac", "actor/grad_norm", "eval/accuracy", "timing/rollout_s", "timing/train_s",
    "timing/sync_s", "perf/tokens_per_s", "policy/version_lag",
]
SFT_STEPS, GRPO_STEPS = QUICKSTART_SFT_STEPS, QUICKSTART_GRPO_STEPS
LORA_STEPS = 40  # LoRA GRPO from the exported SFT model: its +5 points held on both CPUs the suite ran on


@pytest.mark.slow
def test_shortened_quickstart_learns(quickstart_run):
    run_dir, stdout = quickstart_run
    scalars = tensorboard_scalars(run_dir)
    # evals: start of SFT (step 0), end of SFT / start of GRPO (step SFT_STEPS), end of GRPO
    by_step = _accuracy_by_step(run_dir)
    start, after_sft, end = by_step[0][0], by_step[SFT_STEPS][-1], by_step[SFT_STEPS + GRPO_STEPS][-1]
    assert start < 0.05, "the random-init model should not already add"
    assert after_sft >= 0.15, f"SFT warm-up reached only {after_sft:.2f}"
    assert end >= after_sft + 0.05, f"GRPO did not raise accuracy: {after_sft:.3f} -> {end:.3f}"
    rewards = [v for s, v in sorted(scalars["reward/mean"])]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10, "training reward did not rise"
    assert "rft run summary" in stdout and "grpo" in stdout


@pytest.mark.slow
def test_every_promised_scalar_is_logged(quickstart_run):
    run_dir, _ = quickstart_run
    scalars = tensorboard_scalars(run_dir)
    missing = [tag for tag in REQUIRED_SCALARS if tag not in scalars]
    assert not missing, f"missing TensorBoard scalars: {missing}"
    grpo_steps = {s for s, _ in scalars["reward/mean"]}
    assert len(grpo_steps) == GRPO_STEPS
    assert all(v == 0 for _, v in scalars["policy/version_lag"])  # synchronous on-policy
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps"] == SFT_STEPS + GRPO_STEPS
    assert set(summary["stages"]) == {"sft", "grpo"}


def _accuracy_by_step(run_dir: str) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for step, value in sorted(tensorboard_scalars(run_dir)["eval/accuracy"]):
        by_step.setdefault(step, []).append(value)
    return by_step


def _as_verl_parquet(rows_jsonl: str, parquet: str) -> None:
    """The quickstart's arithmetic rows in verl's RL layout: the prompt as chat messages, the answer
    at reward_model.ground_truth, data_source and extra_info beside them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(rows_jsonl) as f:
        rows = [json.loads(line) for line in f]
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "arithmetic", "prompt": [{"role": "user", "content": row["question"]}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": row["answer"]}, "extra_info": {"index": i, "split": "x"}}
        for i, row in enumerate(rows)]), parquet)


@pytest.mark.slow
def test_lora_grpo_from_the_sft_warm_up_learns(quickstart_run, exported_sft_model, tmp_path):
    """Also a user's data and reward as other frameworks keep them: the same tasks in verl's parquet
    layout (`+data=verl`), scored by a verl-style compute_score given as a file beside the launch
    (docs/examples/verl_reward.py), with no PYTHONPATH set."""
    run_dir = str(tmp_path / "lora")
    for split, source in (("train", "train.jsonl"), ("test", "eval.jsonl")):
        _as_verl_parquet(os.path.join(quickstart_run[0], "data", source), str(tmp_path / f"{split}.parquet"))
    shutil.copy(os.path.join(REPO, "docs", "examples", "verl_reward.py"), tmp_path / "my_reward.py")
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "model.tiny=null", f"model.path={exported_sft_model}",
                    "data.arithmetic=null", "+data=verl", f"data.train_path={tmp_path}/train.parquet",
                    f"data.eval_path={tmp_path}/test.parquet", "algorithm.reward=my_reward.py:compute_score",
                    "sync.lora=adapter",
                    "stages=[{name: grpo, algorithm: {name: grpo, lr: 2.0e-3, clip_eps: 0.2}, "
                    f"trainer: {{max_steps: {LORA_STEPS}, save_interval: {LORA_STEPS}, lora: {{rank: 16, alpha: 32}}}}}}]",
                    cwd=str(tmp_path), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the reward's other numbers are logged beside its score (rollout/<key>)
    assert "rollout/answered" in tensorboard_scalars(run_dir)
    by_step = _accuracy_by_step(run_dir)
    start, end = by_step[0][0], by_step[LORA_STEPS][-1]
    assert start >= 0.15, f"the exported SFT model scores only {start:.2f}"
    assert end >= start + 0.05, f"LoRA GRPO did not raise accuracy: {start:.3f} -> {end:.3f}"
    mb = [v for _, v in sorted(tensorboard_scalars(run_dir)["sync/mb"])]
    assert mb[-1] < mb[0] / 5  # after the stage's base weights, each sync carries the adapters alone
    assert not os.listdir(os.path.join(run_dir, "adapters", "engine0"))[1:]  # older versions pruned
    # the checkpoint at the stage's last step holds the adapters beside the frozen weights; rft.export
    # merges them as the stage's end did: the same tensors as the run's final model
    out = os.path.join(run_dir, "exported")
    done = subprocess.run([sys.executable, "-m", "rft.export", run_dir, "--out", out], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"rft.export: checkpoint step {LORA_STEPS} (stage grpo; trainer_ranks=1)" in done.stdout
    own, merged = _tensors(os.path.join(run_dir, "model")), _tensors(out)
    assert sorted(own) == sorted(merged) and all(own[name].equal(merged[name]) for name in own)


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    found = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(directory, name)))
    return found
