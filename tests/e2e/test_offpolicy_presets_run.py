"""The off-policy presets (rec, topr, sppo, asymre, sapo) train for real on the tiny quickstart
model: one launch whose stages are the five presets, one step each, from the quickstart's SFT'd
model (`exported_sft_model`, so that some groups have reward variance). One launch rather than five
more in test_algorithm_presets_run.py's sweep: each launch there costs 30-40 s, mostly start-up,
and the suite is at its hour; a stage more costs a weight sync and a step. A stage takes its
preset's keys from conf/algorithm/<preset>.yaml."""

import json
import math
from pathlib import Path

import yaml

from tests.e2e.helpers import REPO, launch

PRESETS = ["rec", "topr", "sppo", "asymre", "sapo"]
STEPS = 1


def stage(preset: str) -> str:
    """`{name:<preset>,algorithm:{<the preset's keys>},trainer:{max_steps:STEPS}}` as a Hydra override."""
    keys = yaml.safe_load((Path(REPO) / "conf" / "algorithm" / f"{preset}.yaml").read_text())
    algorithm = ",".join(f"{k}:'{v}'" if isinstance(v, str) else f"{k}:{str(v).lower() if isinstance(v, bool) else v}"
                         for k, v in keys.items())
    return f"{{name:{preset},algorithm:{{{algorithm}}},trainer:{{max_steps:{STEPS}}}}}"


def test_the_off_policy_presets_train_in_one_run_with_finite_losses(exported_sft_model, tmp_path):
    result = launch("+experiment=quickstart", "model.tiny=null", f"model.path={exported_sft_model}",
                    f"run.output_dir={tmp_path}", f"stages=[{','.join(stage(p) for p in PRESETS)}]",
                    "rollout.tasks_per_step=16", "data.eval_limit=8", timeout=900)  # evals: at each stage's ends
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    stages = [s["algorithm"]["name"] for s in yaml.safe_load((tmp_path / "config.yaml").read_text())["stages"]]
    assert stages == PRESETS
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    for preset in PRESETS:
        trained = [r for r in rows if r["stage"] == preset]
        assert len(trained) == STEPS, (preset, len(trained))
        for row in trained:
            for key in ("loss/policy", "actor/grad_norm", "actor/entropy"):
                assert math.isfinite(row[key]), (preset, key, row[key])
        # some rows had an advantage: every stage's loss reached the weights (a step without a
        # gradient reports grad_norm 0 and would pass the finiteness check above)
        assert all(r["actor/grad_norm"] > 0 for r in trained), preset
