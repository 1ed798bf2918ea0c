"""Each RL preset trains for real on the tiny quickstart model: 2 steps of the preset from the
quickstart's SFT'd model (`exported_sft_model`, so that some groups have reward variance). Run as
one local sweep (`-m`), which also exercises sweeps on cluster=local: runs one after another, one
output dir each."""

import json
import math
import subprocess
import sys

from tests.e2e.helpers import REPO

PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"]
# what each preset logs beyond the policy's losses (PPO's critic trains beside the policy)
EXTRA_KEYS = {"ppo": ("critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm")}
STEPS = 2
STAGES = "stages=[{name:rl,trainer:{max_steps:%d}}]" % STEPS


def test_every_rl_preset_runs_two_steps_with_finite_losses(exported_sft_model, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=local",
         "model.tiny=null", f"model.path={exported_sft_model}",
         f"algorithm={','.join(PRESETS)}", STAGES, "rollout.tasks_per_step=16", "monitor.progress=false",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for index, preset in enumerate(PRESETS):
        run_dir = tmp_path / str(index)
        assert f"name: {preset}\n" in (run_dir / "config.yaml").read_text()
        rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
        rl = [r for r in rows if r["stage"] == "rl"]
        assert len(rl) == STEPS, preset
        for row in rl:
            for key in ("loss/policy", "actor/grad_norm", "actor/entropy", *EXTRA_KEYS.get(preset, ())):
                assert math.isfinite(row[key]), (preset, key, row[key])
            assert ("critic/value_loss" in row) == (preset == "ppo"), preset  # a critic only where GAE needs one
        if preset == "reinforce_pp":  # KL enters the reward, not the loss
            assert all(r["loss/kl"] == 0.0 for r in rl)
        if preset == "ppo":  # the critic learns: it has a gradient, and its values move between steps
            assert all(r["critic/grad_norm"] > 0 for r in rl)
            assert len({r["critic/values_mean"] for r in rl}) == STEPS
        rollout = [json.loads(line) for line in (run_dir / "metrics" / "rollout1.jsonl").read_text().splitlines()]
        steps = [r for r in rollout if r["stage"] == "rl" and "rollout/groups_kept" in r]  # not the eval rows
        kept = [r["rollout/groups_kept"] for r in steps]
        generated = [r["rollout/groups_generated"] for r in steps]
        if preset == "dapo":  # dynamic sampling: groups without reward variance dropped, batch refilled
            assert sum(generated) > 16 * STEPS, generated  # some groups had no reward variance
        else:
            assert generated == kept == [16.0] * STEPS
