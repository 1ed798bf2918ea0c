"""`+experiment=quickstart_vl` as a user runs it, its warm-up shortened: the tiny Qwen2.5-VL-shaped
model learns from pictures (held-out accuracy from 0 to well above the 25% a model blind to the
image gets), its GRPO stage samples image prompts through vLLM into experience rows that keep the
images, and the model at the end loads in transformers with its image processor and in vLLM,
which reads its picture as the trained model did."""

import glob
import json
import os

import pyarrow.parquet as pq

from tests.e2e.helpers import launch

SFT_STEPS, GRPO_STEPS = 25, 3  # 25 steps: 52% held out on this machine (60, the recipe's: 98%)


def test_the_vision_language_quickstart_learns_to_read_the_picture(tmp_path):
    run = tmp_path / "run"
    result = launch("+experiment=quickstart_vl", f"run.output_dir={run}", f"stages.0.trainer.max_steps={SFT_STEPS}",
                    f"stages.1.trainer.max_steps={GRPO_STEPS}", "monitor.plots=false")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    evals = [json.loads(line) for line in open(run / "metrics" / "eval.jsonl")]
    start, after_sft = evals[0]["accuracy"], next(e for e in evals if e.get("stage") == "sft" and e["when"] == "end")
    assert start <= 0.05 and after_sft["accuracy"] >= start + 0.2 and after_sft["accuracy"] > 0.25 + 0.1, evals
    shards = glob.glob(str(run / "buffer" / "step*.parquet*"))  # consumed shards end in .done
    assert shards, "the GRPO stage wrote no experience"
    table = pq.read_table(shards[0])
    assert "images" in table.column_names and all(table.column("images").to_pylist())  # every row kept its image
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    Qwen2_5_VLForConditionalGeneration.from_pretrained(str(run / "model"))
    assert AutoImageProcessor.from_pretrained(str(run / "model")).merge_size == 2
    assert os.path.isfile(run / "data" / "images" / "eval00000.png")
    _vllm_reads_the_final_model_as_it_was_trained(run, evals[-1]["accuracy"])


def _vllm_reads_the_final_model_as_it_was_trained(run, final_accuracy: float) -> None:
    """vLLM loads the exported model directory and, greedy, names the colours of the held-out
    pictures as often as the run's last eval did with the weights it trained (a vision tower lost
    or mangled in the export reads at chance, 25%)."""
    import asyncio

    from rft.config import ModelConfig, RolloutConfig
    from rft.data.chat_format import chat_format
    from rft.data.images import PLACEHOLDER
    from rft.data.taskset import read_taskset
    from rft.explorer.model_client import ModelClient, Sampling
    from rft.explorer.rewards import first_line_matches
    from rft.explorer.vllm_engine import RolloutEngine

    tasks, _ = read_taskset(str(run / "data" / "eval.jsonl"), "question", "answer", image_key="images")
    engine = RolloutEngine(ModelConfig(name="final", path=str(run / "model")), RolloutConfig(kv_cache_gb=0.1),
                           seed=0, max_model_len=64)
    try:
        greedy = Sampling(max_new_tokens=8, temperature=0.0)
        client = ModelClient(engine, chat_format(engine.tokenizer, False), greedy, seed=0)

        async def replies_to_all():
            return await asyncio.gather(*(client.conversation([{"role": "user", "content": t.prompt}], t.images).reply()
                                          for t in tasks))

        replies = engine.run(replies_to_all())
    finally:
        engine.close()
    assert all(t.prompt.startswith(PLACEHOLDER) for t in tasks)
    right = sum(first_line_matches(r.text, t.answer) for r, t in zip(replies, tasks)) / len(tasks)
    assert abs(right - final_accuracy) <= 0.03, (right, final_accuracy)
