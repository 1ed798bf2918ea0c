"""Tasksets in the layouts the Hugging Face Hub and other frameworks use: prompts as chat messages,
dotted keys for nested columns, a system prompt, gzipped json, folders and globs of shards with
`path@split`, `datasets` save_to_disk folders, and the `+data=verl` / `+data=trinity` shortcuts.
Every file is small and written in tmp_path."""

from __future__ import annotations

import asyncio
import gzip
import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft.config.checks import validate
from rft.data.chat_format import chat_format
from rft.data.prompts import format_prompt, prompt_messages
from rft.data.stage_tasks import read_stage_tasks
from rft.data.taskset import Task, read_taskset
from rft.models.tiny import build_char_tokenizer
from tests.unit.test_config import compose_cfg

# a chat template a char tokenizer can render: role tags around each content, then the cue
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


def verl_row(i: int, question: str | None = None) -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": question or f"{i} + {i} = ?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i}}


def write_jsonl(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def read_verl(spec: str, **kw):
    return read_taskset(spec, "prompt", "reward_model.ground_truth", id_key="extra_info.index", **kw)


def char_tokenizer(template: bool = True):
    tok = build_char_tokenizer()
    if template:
        tok.chat_template = TEMPLATE
    return tok


# --- prompts as chat messages -------------------------------------------------------------------

def test_verl_rows_read_with_messages_prompts_and_dotted_keys(tmp_path):
    tasks, report = read_verl(write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(3)]))
    assert [(t.index, t.prompt, t.answer, t.id, t.system, t.history) for t in tasks] == \
        [(i, f"{i} + {i} = ?", str(2 * i), str(i), None, ()) for i in range(3)]
    assert tasks[0].row["data_source"] == "openai/gsm8k" and report.skipped == 0


def test_a_messages_prompt_keeps_its_system_turn_and_earlier_turns_and_the_template_fills_the_last(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": messages, "answer": "4"}])
    (task,), _ = read_taskset(path, "prompt", "answer", prompt_template="Q: {prompt}")
    assert (task.prompt, task.system, task.history) == ("Q: 2+2?", "Be brief.", tuple(messages[1:3]))
    assert prompt_messages(task) == messages[:3] + [{"role": "user", "content": "Q: 2+2?"}]


@pytest.mark.parametrize("prompt, reason", [
    ([], "prompt 'prompt' is an empty list of messages"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "must end with a user message"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}, {"role": "user", "content": "z"}],
     "prompt[1] is a system message; only the first"),
    ([{"role": "robot", "content": "x"}], "prompt[0].role is 'robot'"),
    ([{"role": "user", "content": ["an", "image"]}], "prompt[0].content[0] must be a {type: text, text} or {type: image} part"),
    (["just text"], "prompt[0] must be a message {role, content} (got str)"),
    ([{"role": "user", "content": "  "}], "must end with a user message that has text"),
])
def test_bad_messages_prompts_are_skipped_naming_the_row_and_key(tmp_path, prompt, reason):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": prompt, "answer": "1"}, {"prompt": "ok", "answer": "2"}])
    tasks, report = read_taskset(path, "prompt", "answer")
    assert [t.index for t in tasks] == [1] and report.skipped == 1
    assert report.skipped_examples[0].startswith("line 1: ") and reason in report.skipped_examples[0]


def test_format_prompt_renders_what_the_workflow_sends(tmp_path):
    """One function gives the messages: the chat template renders them for eval/SFT exactly as the
    single_turn workflow's conversation starts; without a template the contents are joined."""
    from rft.explorer.model_client import Conversation
    from rft.explorer.workflows.single_turn import single_turn

    task = Task(0, "2+2?", "4", system="Be brief.", history=({"role": "user", "content": "1+1?"},
                                                             {"role": "assistant", "content": "2"}))
    for template in (True, False):
        tok = char_tokenizer(template)
        fmt = chat_format(tok, template)

        class Model:  # the ModelClient surface single_turn uses
            format = fmt
            sent = None

            def conversation(self, messages, images=()):
                Model.sent = Conversation(self, messages)
                return self

            async def replies(self, n):
                return []

        asyncio.run(single_turn(task, Model(), SimpleNamespace(samples=2)))
        assert Model.sent.messages == prompt_messages(task)
        text = format_prompt(task, tok, template)
        if template:
            assert text == "[system]Be brief.\n[user]1+1?\n[assistant]2\n[user]2+2?\n[assistant]"
            assert Model.sent.token_ids == tok(text, add_special_tokens=False).input_ids
        else:
            assert text == "Be brief.1+1?22+2?"


def test_a_task_without_prompt_says_which_column_is_missing():
    with pytest.raises(ValueError, match="data.prompt_key"):
        prompt_messages(Task(3, None, "1"))


# --- dotted keys --------------------------------------------------------------------------------

def test_a_column_named_with_a_dot_wins_over_the_nested_field(tmp_path):
    row = {"q": "x", "reward_model.ground_truth": "flat", "reward_model": {"ground_truth": "nested"}}
    (task,), _ = read_taskset(write_jsonl(tmp_path / "t.jsonl", [row]), "q", "reward_model.ground_truth")
    assert task.answer == "flat"


def test_a_missing_nested_key_skips_the_row_naming_the_full_key(tmp_path):
    rows = [verl_row(0), {**verl_row(1), "reward_model": {"style": "rule"}}, {**verl_row(2), "reward_model": "7"},
            {k: v for k, v in verl_row(3).items() if k != "reward_model"}]
    tasks, report = read_verl(write_jsonl(tmp_path / "t.jsonl", rows))
    assert [t.index for t in tasks] == [0] and report.skipped == 3
    assert report.skipped_examples == [
        "line 2: missing key 'reward_model.ground_truth' (row['reward_model'] has: style)",
        "line 3: missing key 'reward_model.ground_truth' (row['reward_model'] is a str)",
        "line 4: missing key 'reward_model.ground_truth' (row has: ability, data_source, extra_info, prompt)"]


def test_dotted_keys_for_preference_pairs_messages_and_list_items(tmp_path):
    pair = {"q": "x", "pair": {"good": "a", "bad": "b"}}
    (task,), _ = read_taskset(write_jsonl(tmp_path / "p.jsonl", [pair]), "q", "pair.good", rejected_key="pair.bad")
    assert (task.answer, task.rejected) == ("a", "b")
    convo = {"data": {"turns": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}}
    (task,), _ = read_taskset(write_jsonl(tmp_path / "m.jsonl", [convo]), "q", "a", messages_key="data.turns")
    assert task.prompt is None
    (task,), _ = read_taskset(write_jsonl(tmp_path / "l.jsonl", [verl_row(5)]), "prompt.0.content",
                              "reward_model.ground_truth")
    assert task.prompt == "5 + 5 = ?"


# --- system prompt ------------------------------------------------------------------------------

def test_system_prompt_setting_column_and_a_prompts_own_system_turn(tmp_path):
    rows = [{"q": "a", "ans": "1"},  # the setting
            {"q": "b", "ans": "2", "sys": "Row's own."},  # the column wins over the setting
            {"q": "c", "ans": "3", "sys": " "},  # blank: the setting
            {"q": [{"role": "system", "content": "Prompt's own."}, {"role": "user", "content": "d"}], "ans": "4",
             "sys": "Row's own."},  # the prompt's own system turn wins over both
            {"q": "e", "ans": "5", "sys": 7}]  # not text: skipped
    tasks, report = read_taskset(write_jsonl(tmp_path / "t.jsonl", rows), "q", "ans", system_key="sys",
                                 system_prompt="Setting.")
    assert [t.system for t in tasks] == ["Setting.", "Row's own.", "Setting.", "Prompt's own."]
    assert report.skipped_examples == ["line 5: system prompt 'sys' must be a string (got int)"]
    assert prompt_messages(tasks[0]) == [{"role": "system", "content": "Setting."}, {"role": "user", "content": "a"}]
    assert read_taskset(write_jsonl(tmp_path / "n.jsonl", rows[:1]), "q", "ans")[0][0].system is None


# --- sources: gzip, folders, globs, save_to_disk, splits ----------------------------------------

def test_gzipped_jsonl_and_json_array(tmp_path):
    rows = [{"q": "x", "a": 1}, {"q": "y", "a": 2}]
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump(rows, f)
    for name in ("t.jsonl.gz", "t.json.gz"):
        tasks, _ = read_taskset(str(tmp_path / name), "q", "a")
        assert tasks == [Task(0, "x", "1"), Task(1, "y", "2")]


def _summary(tasks: list[Task]) -> list[tuple]:
    return [(t, t.row, t.id) for t in tasks]


def test_shards_in_the_hub_layout_give_the_rows_of_the_single_file(tmp_path):
    rows = [verl_row(i) for i in range(7)]
    rows[4] = {**rows[4], "prompt": []}  # one bad row: skipped at the same index either way
    whole = read_verl(write_parquet(tmp_path / "whole.parquet", rows))
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00002.parquet", rows[:3])
    write_parquet(hub / "data" / "train-00001-of-00002.parquet", rows[3:])
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", rows[:1])
    (hub / "README.md").write_text("---\nconfigs: ...\n---\n")
    sharded = read_verl(f"{hub}@train")
    assert _summary(sharded[0]) == _summary(whole[0]) and sharded[1].skipped == whole[1].skipped == 1
    assert sharded[1].skipped_examples == [
        "train-00001-of-00002.parquet row 1: prompt 'prompt' is an empty list of messages"]
    assert [t.index for t in read_verl(f"{hub}@test")[0]] == [0]
    # a split per folder (the Hub's parquet conversion), and a glob
    for i, part in enumerate((rows[:3], rows[3:])):
        write_parquet(tmp_path / "conv" / "default" / "train" / f"{i}.parquet", part)
    assert _summary(read_verl(str(tmp_path / "conv"))[0]) == _summary(whole[0])
    assert _summary(read_verl(str(hub / "data" / "train-*.parquet"))[0]) == _summary(whole[0])


def test_jsonl_shards_count_lines_as_the_concatenated_file_would(tmp_path):
    lines = [json.dumps({"q": "a", "a": 1}), "", "{bad", json.dumps({"q": "b", "a": 2}), "",
             json.dumps({"q": "c", "a": 3})]
    (tmp_path / "whole.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "part-0.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (tmp_path / "parts" / "part-1.jsonl").write_text("\n".join(lines[2:]) + "\n")
    whole = read_taskset(str(tmp_path / "whole.jsonl"), "q", "a")
    sharded = read_taskset(str(tmp_path / "parts"), "q", "a")
    assert whole[0] == sharded[0] and [t.index for t in whole[0]] == [0, 3, 5]
    assert sharded[1].skipped_examples == ["part-1.jsonl line 1: invalid JSON (JSONDecodeError: Expecting property "
                                           "name enclosed in double quotes: line 1 column 2 (char 1))"]


def save_to_disk(folder, shards: list[list[dict]], split: str | None = None) -> None:
    """A folder as `datasets.Dataset.save_to_disk` writes it: Arrow stream files listed in state.json."""
    folder.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards):
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_split": split}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))


def test_save_to_disk_folders_give_the_rows_of_the_single_file(tmp_path):
    rows = [verl_row(i) for i in range(5)]
    whole = read_verl(write_parquet(tmp_path / "whole.parquet", rows))[0]
    save_to_disk(tmp_path / "ds", [rows[:2], rows[2:]])
    assert _summary(read_verl(str(tmp_path / "ds"))[0]) == _summary(whole)
    save_to_disk(tmp_path / "dd" / "train", [rows])
    save_to_disk(tmp_path / "dd" / "test", [rows[:1]])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert _summary(read_verl(f"{tmp_path / 'dd'}@train")[0]) == _summary(whole)
    assert len(read_verl(f"{tmp_path / 'dd'}@test")[0]) == 1


def test_a_folder_written_by_datasets_itself(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [verl_row(i) for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows).select([1, 3])}).save_to_disk(str(tmp_path / "dd"))
    whole = read_verl(write_parquet(tmp_path / "w.parquet", rows))[0]
    assert _summary(read_verl(f"{tmp_path / 'dd'}@train")[0]) == _summary(whole)
    assert [t.id for t in read_verl(f"{tmp_path / 'dd'}@test")[0]] == ["1", "3"]


@pytest.mark.parametrize("spec, message", [
    ("hub", r"'.*hub' holds the splits \['test', 'train'\]; name one, e.g. '.*hub@train'"),
    ("hub@validation", r"'.*hub' has no split 'validation'; its splits: \['test', 'train'\]"),
    ("hub/data/train-00000-of-00001.parquet@train", "is one file, one split: drop '@train'"),
    ("configs@train", r"holds split 'train' in 2 folders \(main, socratic\): point the path at one of them"),
    ("nothing/*.parquet", "does not exist"),
    ("empty", "holds no taskset files"),
    ("t.csv", "unknown extension"),
])
def test_source_errors_name_the_path_and_list_the_splits(tmp_path, spec, message):
    write_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", [verl_row(0)])
    write_parquet(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet", [verl_row(1)])
    write_parquet(tmp_path / "configs" / "main" / "train-00000-of-00001.parquet", [verl_row(0)])
    write_parquet(tmp_path / "configs" / "socratic" / "train-00000-of-00001.parquet", [verl_row(0)])
    (tmp_path / "empty").mkdir()
    (tmp_path / "t.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match=message):
        read_verl(str(tmp_path / spec))


def test_no_valid_rows_in_verls_layout_hints_at_the_shortcut(tmp_path):
    with pytest.raises(ValueError, match=r"look like verl's layout: add `\+data=verl`.*after any \+experiment"):
        read_taskset(write_parquet(tmp_path / "t.parquet", [verl_row(0)]), "question", "answer")


# --- the layout shortcuts and the launch checks -------------------------------------------------

def test_plus_data_verl_composes_validates_and_reads_a_verl_folder(tmp_path):
    hub = tmp_path / "gsm8k"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", [verl_row(i) for i in range(4)])
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", [verl_row(i) for i in range(2)])
    cfg = compose_cfg("+experiment=quickstart", "+data=verl", f"run.output_dir={tmp_path}", "data.arithmetic=null",
                      f"data.train_path={hub}@train", f"data.eval_path={hub}@test", "data.system_prompt=Be brief.")
    validate(cfg)
    data = cfg.data
    assert (data.prompt_key, data.answer_key, data.id_key, data.prompt_template) == \
        ("prompt", "reward_model.ground_truth", "extra_info.index", "{prompt}")
    rows: dict = {}
    tasks = read_stage_tasks(data.train_path, data, rows)
    assert [(t.prompt, t.answer, t.task_id, t.system) for t in tasks][1] == ("1 + 1 = ?", "2", "1", "Be brief.")
    assert rows == {f"{hub}@train": {"malformed": 0}}
    # the experiment's own keys (prompt_key=question, ...) are replaced when +data=verl comes after it
    gsm8k = compose_cfg("+experiment=gsm8k_grpo", "model=smollm2_135m", "+data=verl", f"run.output_dir={tmp_path}")
    assert (gsm8k.data.prompt_key, gsm8k.data.prompt_template) == ("prompt", "{prompt}")


def test_plus_data_trinity_maps_trinitys_default_keys(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "response": "2"}])
    cfg = compose_cfg("+experiment=quickstart", "+data=trinity", f"run.output_dir={tmp_path}", "data.arithmetic=null",
                      f"data.train_path={path}", f"data.eval_path={path}")
    validate(cfg)
    assert (cfg.data.prompt_key, cfg.data.answer_key, cfg.data.messages_key) == ("prompt", "response", "message")
    assert read_stage_tasks(path, cfg.data, {})[0].answer == "2"


@pytest.mark.parametrize("key", ["data.train_path", "data.eval_path"])
def test_launch_check_names_the_key_and_the_splits(tmp_path, key):
    write_parquet(tmp_path / "hub" / "train.parquet", [verl_row(0)])
    write_parquet(tmp_path / "hub" / "validation.parquet", [verl_row(0)])
    cfg = compose_cfg("+experiment=quickstart", "+data=verl", f"run.output_dir={tmp_path}", "data.arithmetic=null",
                      f"data.train_path={tmp_path / 'hub'}@train", f"data.eval_path={tmp_path / 'hub'}@validation",
                      f"{key}={tmp_path / 'hub'}")
    with pytest.raises(ValueError, match=rf"{key}=.*holds the splits \['train', 'validation'\]"):
        validate(cfg)
