"""Rows longer than the model's context are skipped and counted, truncated from the left, or stop
the run naming the row (data.overlong), before any reaches vLLM or Megatron. Real tokenizers: the
quickstart's character tokenizer and SmolLM2's BPE with its chat template."""

import os

import pytest

from rft.data.context_fit import ContextFit
from rft.data.prompts import format_prompt, reference_response
from rft.data.taskset import Task, row_scalars
from rft.models.tiny import build_char_tokenizer

SMOLLM2 = os.environ.get("RFT_SMOLLM2_DIR", os.path.expanduser("~/.cache/rft/models/smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def chars():
    return build_char_tokenizer()


def tasks(*prompts: str, answer: str = "12") -> list[Task]:
    return [Task(index=i, prompt=p, answer=answer) for i, p in enumerate(prompts)]


def test_rollout_rows_must_leave_room_for_the_response(chars):
    rows: dict = {}
    fit = ContextFit(chars, chat_template=False, context=16)
    kept = fit.for_rollouts(tasks("1+1=", "12345678+1=", "1" * 40), "t.jsonl", 6, rows)
    # 4 + 6 and 11 + 6 tokens: the second needs 17 > 16
    assert [t.index for t in kept] == [0]
    assert rows["t.jsonl"] == {"overlong_skipped": 2, "truncated": 0}


def test_reference_rows_count_the_answer_and_eos(chars):
    fit = ContextFit(chars, chat_template=False, context=10)
    rows: dict = {}
    # "1+1=" (4) + "2" + EOS (2) = 6 fits; "1+1=" + "1234567" + EOS = 12 does not
    kept = fit.for_references([Task(0, "1+1=", "2"), Task(1, "1+1=", "1234567")], "sft.jsonl", rows)
    assert [t.index for t in kept] == [0]
    assert len(reference_response("2", chars)) == 2
    # DPO: the longer of chosen and rejected decides
    pairs = [Task(0, "1+1=", "2", rejected="3"), Task(1, "1+1=", "2", rejected="123456789")]
    assert [t.index for t in fit.for_references(pairs, "pairs.jsonl", rows, preferences=True)] == [0]
    assert rows["pairs.jsonl"]["overlong_skipped"] == 1


def test_truncate_left_keeps_the_end_of_the_prompt(chars):
    fit = ContextFit(chars, chat_template=False, context=16, policy="truncate_left")
    rows: dict = {}
    kept = fit.for_rollouts(tasks("abcdefghij1+1="), "t.jsonl", 6, rows)
    assert [t.prompt for t in kept] == ["efghij1+1="]  # exactly 16 - 6 tokens: the start went
    assert kept[0].index == 0 and kept[0].answer == "12"
    assert rows["t.jsonl"] == {"overlong_skipped": 0, "truncated": 1}


def test_truncate_left_skips_a_row_whose_response_alone_does_not_fit(chars):
    fit = ContextFit(chars, chat_template=False, context=8, policy="truncate_left")
    rows: dict = {}
    kept = fit.for_references([Task(0, "1+1=", "2"), Task(1, "1+1=", "12345678")], "sft.jsonl", rows)
    assert [t.index for t in kept] == [0]
    assert rows["sft.jsonl"] == {"overlong_skipped": 1, "truncated": 0}


def test_error_names_the_row_its_length_and_the_fix(chars):
    fit = ContextFit(chars, chat_template=False, context=16, policy="error")
    with pytest.raises(ValueError) as err:
        fit.for_rollouts(tasks("1+1=", "1" * 40), "data/train.jsonl", 6, {})
    message = str(err.value)
    assert "line 2 of data/train.jsonl needs 46 tokens (prompt 40 + response 6)" in message
    assert "context of 16" in message and "data.overlong=skip or truncate_left" in message
    with pytest.raises(ValueError, match="row 1 of data/train.parquet"):
        fit.for_rollouts(tasks("1+1=", "1" * 40), "data/train.parquet", 6, {})


def test_a_taskset_with_no_row_that_fits_is_an_error(chars):
    fit = ContextFit(chars, chat_template=False, context=8)
    with pytest.raises(ValueError, match="every row of t.jsonl is longer than the model's context of 8 tokens"):
        fit.for_rollouts(tasks("123456", "1234567"), "t.jsonl", 4, {})


def test_row_scalars_sum_a_stages_files():
    rows = {"train.jsonl": {"malformed": 2, "overlong_skipped": 1, "truncated": 0},
            "eval.jsonl": {"malformed": 0, "overlong_skipped": 3, "truncated": 4}}
    assert row_scalars(rows, ["train.jsonl", "eval.jsonl", None]) == {
        "data/malformed_rows": 2.0, "data/overlong_skipped": 4.0, "data/overlong_truncated": 4.0}
    assert row_scalars(rows, ["train.jsonl", "train.jsonl"])["data/malformed_rows"] == 2.0  # a file once


@pytest.mark.skipif(not os.path.isdir(SMOLLM2), reason="run `python tools/prepare_smollm2.py` first")
def test_truncate_left_with_a_chat_template_keeps_the_scaffolding():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    question = " ".join(f"word{i}" for i in range(300)) + " What is 2 + 2?"
    task = Task(0, question, "4")
    full = len(tokenizer(format_prompt(task, tokenizer, True))["input_ids"])
    fit = ContextFit(tokenizer, chat_template=True, context=200, policy="truncate_left")
    rows: dict = {}
    (kept,) = fit.for_rollouts([task], "gsm8k.jsonl", 64, rows)
    prompt = format_prompt(kept, tokenizer, True)
    assert full > 200 and len(tokenizer(prompt)["input_ids"]) <= 200 - 64
    assert kept.prompt.endswith("What is 2 + 2?") and not kept.prompt.startswith("word0 ")
    assert prompt.startswith(format_prompt(Task(0, "", "4"), tokenizer, True).split("user")[0])  # system turn kept
    assert prompt.rstrip().endswith("assistant")  # the generation cue survives
    assert rows["gsm8k.jsonl"]["truncated"] == 1
