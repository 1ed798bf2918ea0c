"""A PPO run resumed from a checkpoint retrains the step after it exactly as the first attempt did:
the critic's weights and its optimizer come back with the policy's (a critic rebuilt from the
policy instead, or one without its Adam moments, would score the batch differently)."""

import json

import pytest

from tests.e2e.helpers import launch

SFT_STEPS, PPO_STEPS = 20, 3
CHECKPOINT = SFT_STEPS + 2  # one PPO step after it
CRITIC_KEYS = ("critic/value_loss", "critic/values_mean", "critic/returns_mean", "critic/grad_norm")


def _rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines())}


def test_ppo_resume_restores_the_critic(tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["+experiment=quickstart", "algorithm=ppo", f"run.output_dir={run_dir}", "rollout.tasks_per_step=16",
                 f"trainer.save_interval={CHECKPOINT}", f"stages.0.trainer.max_steps={SFT_STEPS}",
                 f"stages.1.trainer.max_steps={PPO_STEPS}"]
    first = launch(*overrides)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    before = _rows(run_dir)[CHECKPOINT + 1]
    assert (run_dir / "checkpoints" / f"step{CHECKPOINT:08d}").is_dir()

    again = launch(*overrides, "run.resume=require")  # the finished run dir: from its newest checkpoint
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*_0_log.out"))
    assert f"checkpoints/step{CHECKPOINT:08d} ({CHECKPOINT} steps done)" in logs
    after = _rows(run_dir)[CHECKPOINT + 1]
    for key in CRITIC_KEYS + ("loss/policy", "reward/mean"):
        assert after[key] == pytest.approx(before[key], rel=1e-6, abs=1e-9), key
