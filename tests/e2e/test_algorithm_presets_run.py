"""Each RL preset trains for real on the tiny quickstart model, from the quickstart's SFT'd model
(`exported_sft_model`, so that some groups have reward variance): one launch whose stages are the
presets, two steps each, a stage taking its preset's keys from conf/algorithm/<preset>.yaml. One
launch rather than a sweep of one launch per preset: a launch costs 30-40 s, mostly start-up, and
a stage more costs a weight sync, an eval of 8 tasks and its steps. (Sweeps on cluster=local are
run by tests/e2e/test_families_run.py.) The distillation presets need a teacher and run in
tests/e2e/test_distillation.py."""

import json
import math
from pathlib import Path

import yaml

from tests.e2e.helpers import REPO, launch

PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo",
           "rec", "topr", "sppo", "asymre", "sapo"]
# what each preset logs beyond the policy's losses (PPO's critic trains beside the policy)
EXTRA_KEYS = {"ppo": ("critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm")}
STEPS = 2
TASKS = 16


def stage(preset: str) -> str:
    """`{name:<preset>,algorithm:{<the preset's keys>},trainer:{max_steps:STEPS}}` as a Hydra override."""
    keys = yaml.safe_load((Path(REPO) / "conf" / "algorithm" / f"{preset}.yaml").read_text())
    algorithm = ",".join(f"{k}:'{v}'" if isinstance(v, str) else f"{k}:{str(v).lower() if isinstance(v, bool) else v}"
                         for k, v in keys.items())
    return f"{{name:{preset},algorithm:{{{algorithm}}},trainer:{{max_steps:{STEPS}}}}}"


def test_every_rl_preset_trains_two_steps_with_finite_losses(exported_sft_model, tmp_path):
    result = launch("+experiment=quickstart", "model.tiny=null", f"model.path={exported_sft_model}",
                    f"run.output_dir={tmp_path}", f"stages=[{','.join(stage(p) for p in PRESETS)}]",
                    f"rollout.tasks_per_step={TASKS}", "data.eval_limit=8", timeout=1800)  # evals: at each stage's ends
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stages = yaml.safe_load((tmp_path / "config.yaml").read_text())["stages"]
    assert [s["algorithm"]["name"] for s in stages] == PRESETS
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    rollout = [json.loads(line) for line in (tmp_path / "metrics" / "rollout1.jsonl").read_text().splitlines()]
    for preset in PRESETS:
        trained = [r for r in rows if r["stage"] == preset]
        assert len(trained) == STEPS, (preset, len(trained))
        for row in trained:
            for key in ("loss/policy", "actor/grad_norm", "actor/entropy", *EXTRA_KEYS.get(preset, ())):
                assert math.isfinite(row[key]), (preset, key, row[key])
            assert ("critic/value_loss" in row) == (preset == "ppo"), preset  # a critic only where GAE needs one
        # some rows had an advantage: every stage's loss reached the weights (a step without a
        # gradient reports grad_norm 0 and would pass the finiteness check above)
        assert all(r["actor/grad_norm"] > 0 for r in trained), preset
        if preset == "reinforce_pp":  # KL enters the reward, not the loss
            assert all(r["loss/kl"] == 0.0 for r in trained)
        if preset == "ppo":  # the critic learns: it has a gradient, and its values move between steps
            assert all(r["critic/grad_norm"] > 0 for r in trained)
            assert len({r["critic/values_mean"] for r in trained}) == STEPS
        steps = [r for r in rollout if r["stage"] == preset and "rollout/groups_kept" in r]  # not the eval rows
        kept = [r["rollout/groups_kept"] for r in steps]
        generated = [r["rollout/groups_generated"] for r in steps]
        if preset == "dapo":  # dynamic sampling: groups without reward variance dropped, batch refilled
            assert sum(generated) > TASKS * STEPS, generated  # some groups had no reward variance
        else:
            assert generated == kept == [float(TASKS)] * STEPS, preset
