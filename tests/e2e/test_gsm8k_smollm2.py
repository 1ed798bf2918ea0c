"""The GSM8K GRPO recipe runs for real on CPU with SmolLM2-135M-Instruct: rollouts from vLLM scored
by math-verify, a Megatron GRPO step with the KL reference, weights synced back to vLLM."""

import json
import os

import pytest

from tests.e2e.helpers import launch, tensorboard_scalars

# SmolLM2-135M on GSM8K through the launcher; the model's preparation is also checked by test_smollm2_prepare
pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from rft.models.smollm2 import DEFAULT_DIR, is_prepared

    path = os.environ.get("RFT_SMOLLM2_DIR", DEFAULT_DIR)
    if not is_prepared(path):
        pytest.skip(f"SmolLM2 not prepared at {path}; run `python tools/prepare_smollm2.py`")
    return path


@pytest.mark.slow
def test_gsm8k_grpo_one_step_on_cpu(tmp_path, gsm8k_dir, smollm2_dir):
    # a train file with a few malformed rows: they are skipped, counted and reported
    rows = open(os.path.join(gsm8k_dir, "train.jsonl")).read().splitlines()[:64]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows + ['{"question": "no answer"}', "{not json"]) + "\n")
    run_dir = tmp_path / "run"
    result = launch("+experiment=gsm8k_grpo", "model=smollm2_135m", f"model.path={smollm2_dir}",
                    f"run.output_dir={run_dir}", f"data.train_path={train}", "trainer.max_steps=1",
                    "rollout.tasks_per_step=2", "rollout.max_new_tokens=96", "data.eval_limit=4",
                    "rollout.kv_cache_gb=1", "trainer.micro_batch_size=4", timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    scalars = tensorboard_scalars(str(run_dir))
    assert [s for s, _ in scalars["loss/policy"]] == [1]
    assert 0.0 <= scalars["reward/mean"][0][1] <= 1.0
    assert scalars["loss/kl"][0][1] >= -1e-8  # >= 0 in exact arithmetic; fp32 rounding gave -2.3e-10
    assert len(scalars["eval/accuracy"]) == 2  # before and after the step
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["skipped_rows"][str(train)]["malformed"] == 2
    assert "skipped 2 malformed rows" in result.stdout
    shard = [n for n in os.listdir(run_dir / "buffer") if n.endswith(".done")]
    assert len(shard) == 1, "the one experience shard was consumed exactly once"
