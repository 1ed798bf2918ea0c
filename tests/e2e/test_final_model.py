"""A finished run leaves its model (trainer.save_model, on by default): each stage's at
<run>/models/<stage> and the last stage's also at <run>/model, HF directories the summary names.
transformers and vLLM load it; greedy decoding it on the run's held-out tasks scores what the run's
own last eval did; it gives the logprobs the trainer's own model (its last checkpoint, loaded in
megatron-core) gives held-out rows. All on the shared shortened quickstart (tests/conftest.py)."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.helpers import QUICKSTART_GRPO_STEPS, QUICKSTART_SFT_STEPS

LAST_STEP = QUICKSTART_SFT_STEPS + QUICKSTART_GRPO_STEPS  # the fixture checkpoints there
ROWS = 16  # held-out rows whose logprobs are compared


def _eval_rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "data", "eval.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_run_leaves_each_stages_model_and_says_where(quickstart_run):
    run_dir, stdout = quickstart_run
    assert os.path.realpath(os.path.join(run_dir, "model")) == os.path.join(run_dir, "models", "grpo")
    said = " ".join(stdout.split())
    assert f"model: {run_dir}/model (stage grpo; an HF directory: transformers, vLLM, mode=bench)" in said
    assert f"{run_dir}/models/sft (stage sft)" in said
    source = os.path.join(run_dir, "initial_model")
    for stage in ("sft", "grpo"):
        made = set(os.listdir(os.path.join(run_dir, "models", stage)))
        # every file of the model it started from besides the weights: tokenizer, templates, configs
        assert {name for name in os.listdir(source) if not name.endswith(".safetensors")} <= made, made
        assert "model.safetensors.index.json" in made
    with open(os.path.join(run_dir, "model", "config.json")) as f:
        config = json.load(f)
    assert config.get("dtype", config.get("torch_dtype")) == "float32"  # model.dtype (transformers 5 says dtype)


@pytest.mark.slow
def test_transformers_greedy_on_the_held_out_tasks_scores_the_summarys_final_accuracy(quickstart_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = quickstart_run
    with open(os.path.join(run_dir, "summary.json")) as f:
        reported = json.load(f)["stages"]["grpo"]["end"]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "model")).eval()
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(run_dir, "model"))
    rows = _eval_rows(run_dir)
    by_length: dict[int, list[dict]] = {}
    for row in rows:  # prompts of one length batch without padding
        by_length.setdefault(len(tokenizer(row["question"]).input_ids), []).append(row)
    solved = 0
    with torch.no_grad():
        for group in by_length.values():
            ids = torch.tensor([tokenizer(row["question"]).input_ids for row in group])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
            for row, tokens in zip(group, out[:, ids.shape[1]:]):
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                solved += text.split("\n")[0].strip() == row["answer"]  # exact_match's rule
    # vLLM sampled the run's eval (greedy, fp32); transformers sums in another order, so a near tie
    # may break the other way on a few of the 200 tasks: 3 points is 6 tasks
    assert solved / len(rows) == pytest.approx(reported, abs=0.03), (solved / len(rows), reported)


@pytest.mark.slow
def test_transformers_and_vllm_give_the_trainers_logprobs_from_the_final_model(quickstart_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft.config import ModelConfig, RolloutConfig
    from rft.explorer.vllm_engine import RolloutEngine

    run_dir, _ = quickstart_run
    final = os.path.join(run_dir, "model")
    tokenizer = AutoTokenizer.from_pretrained(final)
    rows = [(tokenizer(row["question"]).input_ids, tokenizer(row["answer"]).input_ids + [tokenizer.eos_token_id])
            for row in _eval_rows(run_dir)[:ROWS]]
    # the trainer's model, from the run's last checkpoint (a process of its own: it opens a process group)
    script = os.path.join(os.path.dirname(__file__), "checkpoint_logprobs.py")
    done = subprocess.run([sys.executable, script, run_dir, str(LAST_STEP), json.dumps(rows)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    trainer = json.loads(done.stdout.strip().splitlines()[-1])

    model = AutoModelForCausalLM.from_pretrained(final).eval()
    hf = []
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            hf.append(logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]].tolist())

    engine = RolloutEngine(ModelConfig(name="final", path=final), RolloutConfig(kv_cache_gb=0.1), 0, 64)
    try:
        every = engine.prompt_logprobs([prompt + response for prompt, response in rows])
    finally:
        engine.close()
    vllm = [logprobs[len(prompt) - 1:] for logprobs, (prompt, _) in zip(every, rows)]

    # fp32 all three; megatron-core, transformers and vLLM's CPU kernels sum in other orders: agreement
    # to float32 rounding over a 2-layer model (measured max |diff|: see the note in each assert)
    for name, other, tolerance in (("transformers", hf, 1e-4), ("vLLM", vllm, 1e-3)):
        worst = max(abs(a - b) for t, o in zip(trainer, other) for a, b in zip(t, o))
        assert worst < tolerance, f"{name} vs the trainer: max |logprob difference| {worst:.2e}"
        assert all(len(t) == len(o) for t, o in zip(trainer, other))
