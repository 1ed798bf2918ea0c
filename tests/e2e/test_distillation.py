"""On-policy distillation (reverse KL, then JSD) and CHORD in the quickstart, through the real
launcher, in one run:

- distill: the student (the quickstart's model at the end of its shortened SFT warm-up) samples, a
  judge rank serves the teacher (the quickstart's model at the run's end, after GRPO) on a frozen vLLM engine,
  which scores every sampled token (`prompt_logprobs`); the trainer follows the per-token reverse
  KL. The student gains held-out accuracy towards the teacher's, the reverse KL to the teacher
  falls, every row was scored, and the teacher's weights are the same bytes after the run.
- chord: GRPO on the policy's samples plus SFT on the taskset's answers in one loss, two steps.
- jsd: distillation again, with the generalised Jensen-Shannon estimator (beta 0.3, not its default),
  a few steps: the teacher scores every row again after a stage without it, and each step's policy
  loss is minus the mean JSD advantage recomputed from the step's shard. On-policy with one
  optimizer step the PPO loss is -mean(A) (ratio 1), so it tells which estimator the trainer ran:
  under on_policy_distill it equals distill/reverse_kl (checked on the distill stage), under jsd
  (1 - beta) mean(log pi_s - log m), measured at a tenth of the reverse KL or less; had beta not
  reached the estimator (its default 0.5 in its place), it would have been 40% or more off.
"""

import glob
import hashlib
import json
import math
import os

import pytest

from tests.e2e.helpers import launch, tensorboard_scalars

DISTILL, CHORD, JSD = 20, 2, 4
JSD_BETA = 0.3


def _weights_digest(model_dir: str) -> str:
    """sha256 over the model's weight files (an export may be sharded)."""
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        with open(os.path.join(model_dir, name), "rb") as f:
            digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _rows(run_dir, name: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics", name)) as f:
        return [json.loads(line) for line in f]


def test_a_student_distilled_from_a_frozen_teacher_gains_and_chord_mixes_expert_rows(
        exported_sft_model, exported_grpo_model, tmp_path):
    before = _weights_digest(exported_grpo_model)
    run_dir = str(tmp_path / "run")
    result = launch(
        "+experiment=quickstart", f"run.output_dir={run_dir}", "model.tiny=null", f"model.path={exported_sft_model}",
        "cluster.judge_ranks=1", f"judge.model={exported_grpo_model}",
        "stages=[{name: distill, algorithm: {name: on_policy_distill, advantage: on_policy_distill, group_size: 4, "
        f"lr: 3.0e-4}}, trainer: {{max_steps: {DISTILL}}}}}, "
        "{name: chord, algorithm: {name: chord, expert_rows: 16, chord_mu_peak: 0.5, chord_mu_valley: 0.1, "
        f"chord_mu_decay_steps: {CHORD}, lr: 3.0e-4}}, trainer: {{max_steps: {CHORD}}}}}, "
        f"{{name: jsd, algorithm: {{name: jsd, advantage: jsd, jsd_beta: {JSD_BETA}, group_size: 4, lr: 3.0e-4}}, "
        f"trainer: {{max_steps: {JSD}}}}}]")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    accuracy = sorted(tensorboard_scalars(run_dir)["eval/accuracy"])
    start, distilled = accuracy[0][1], [v for s, v in accuracy if s == DISTILL][0]
    # measured on 2 cores from a weaker pair (student 18%, teacher 42%): +6.5 points in 20 steps
    assert distilled >= start + 0.03, f"distillation did not raise accuracy: {start:.3f} -> {distilled:.3f}"
    trainer = _rows(run_dir, "trainer0.jsonl")
    distill = [r for r in trainer if r["stage"] == "distill"]
    kl = [r["distill/reverse_kl"] for r in distill]
    assert sum(kl[-3:]) < sum(kl[:3]), f"the student did not move towards the teacher: reverse KL {kl}"
    assert all(r["distill/rows_unscored"] == 0 for r in distill)
    rollout = [r for r in _rows(run_dir, "rollout1.jsonl") if r["stage"] == "distill" and "judge/calls" in r]
    assert len(rollout) == DISTILL and all(r["judge/calls"] > 0 and r["rollout/teacher_unscored"] == 0 for r in rollout)
    assert _weights_digest(exported_grpo_model) == before  # the teacher was served, never updated

    chord = [r for r in trainer if r["stage"] == "chord"]
    assert [r["chord/mu"] for r in chord] == pytest.approx([0.5, 0.3])  # cosine from the peak, half way to the valley
    assert all(math.isfinite(r["loss/chord_sft"]) and r["loss/chord_sft"] > 0 for r in chord)

    # the loss each distillation stage's trainer took: its estimator's, not the other's
    for row in distill[:3]:
        assert row["loss/policy"] == pytest.approx(row["distill/reverse_kl"], rel=1e-3, abs=1e-6), row
    jsd = [r for r in trainer if r["stage"] == "jsd"]
    assert [r["step"] for r in jsd] == list(range(DISTILL + CHORD + 1, DISTILL + CHORD + JSD + 1))
    for row in jsd:
        expected, reverse_kl = _distill_losses(run_dir, row["step"], JSD_BETA)
        assert row["distill/rows_unscored"] == 0 and row["distill/reverse_kl"] == pytest.approx(reverse_kl, abs=1e-4)
        assert row["loss/policy"] == pytest.approx(expected, rel=1e-3, abs=1e-6), (row, expected)
        assert abs(row["loss/policy"] - reverse_kl) > 0.3 * abs(reverse_kl), (row, expected)
        assert row["actor/grad_norm"] > 0 and row["train/optimizer_steps"] == 1  # the student moved
    rollout = [r for r in _rows(run_dir, "rollout1.jsonl") if r["stage"] == "jsd" and "judge/calls" in r]
    assert len(rollout) == JSD and all(r["judge/calls"] > 0 and r["rollout/teacher_unscored"] == 0 for r in rollout)


def _distill_losses(run_dir: str, step: int, beta: float) -> tuple[float, float]:
    """(the PPO loss at ratio 1 under jsd, -mean A = (1 - beta) x mean(log pi_s - log m), and the
    reverse KL's estimate, mean(log pi_s - log pi_t)) over the sampled tokens of the shard that
    trainer step `step` trained on, from the logprobs the explorer wrote."""
    import pyarrow.parquet as pq
    import torch

    from rft.buffer.experience import from_table
    from rft.trainer.step_batch import StepBatch, response_tensors, teacher_tensors

    paths = sorted(glob.glob(os.path.join(run_dir, "buffer", f"step{step - 1:08d}-*.parquet*")))
    batch = StepBatch.from_experiences([e for path in paths for e in from_table(pq.read_table(path))])
    mask, student = response_tensors(batch)
    teacher, scored = teacher_tensors(batch, mask)
    assert paths and bool(scored.all())
    mixture = torch.logaddexp(teacher + math.log(beta), student + math.log(1 - beta))
    tokens = mask.sum()
    jsd_loss = (1 - beta) * ((student - mixture) * mask).sum() / tokens
    return float(jsd_loss), float(((student - teacher) * mask).sum() / tokens)
