"""Task operators: the built-ins' exact keeps and drops, apply_task_operators' report and cleaned
file, user operators by dotted path, and the errors that name the operator and option."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from rft.data.task_operators import (TASK_OPERATORS, apply_task_operators, cleaned_paths, dedup, language_filter,
                                     length_filter)
from rft.data.taskset import Task, read_taskset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GSM = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
       "How many clips did Natalia sell altogether in April and May?")
ROWS = [
    {"id": "q0", "question": "What is 2 plus 3?", "answer": "5", "source": "a"},
    {"id": "q1", "question": "what  is 2 PLUS 3?", "answer": "5", "source": "a"},  # exact dup of q0 (normalised)
    {"id": "q2", "question": GSM, "answer": "72", "source": "b", "meta": {"level": 1, "tags": ["x"]}},
    {"id": "q3", "question": GSM.replace("May?", "May ?"), "answer": "72", "source": "b"},  # near dup of q2
    {"id": "q4", "question": "Wie viele Äpfel hat Tom, wenn er drei davon verschenkt?", "answer": "2", "source": "c"},
    {"id": "q5", "question": "Combien de pommes reste-t-il à Marie après en avoir mangé deux?", "answer": "3",
     "source": "c"},
    {"id": "q6", "question": "12+7=", "answer": "19", "source": "d"},
    {"id": "q7", "question": "Solve for x: 3x + 5 = 20.", "answer": "5", "source": "d"},  # langdetect says 'da'
    {"id": "q8", "question": "What is the sum of the first ten positive integers?", "answer": "55", "source": "d"},
]


def _tasks(tmp_path, rows=ROWS, template: str = "{prompt}") -> list[Task]:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tasks, _ = read_taskset(str(path), "question", "answer", prompt_template=template, id_key="id")
    return tasks


def _ids(tasks: list[Task]) -> list[str]:
    return [t.task_id for t in tasks]


def test_builtins_are_registered():
    assert TASK_OPERATORS.names() == ["dedup", "language_filter", "length_filter"]


def test_dedup_exact_keeps_the_first_occurrence(tmp_path):
    tasks = _tasks(tmp_path)
    assert _ids(dedup(tasks)) == ["q0", "q2", "q3", "q4", "q5", "q6", "q7", "q8"]
    assert _ids(dedup(list(reversed(tasks))))[-1] == "q1"  # whichever comes first is kept
    assert _ids(dedup(tasks, key="answer")) == ["q0", "q2", "q4", "q5", "q6", "q8"]  # "5" x3, "72" x2
    assert _ids(dedup(tasks, key="source")) == ["q0", "q2", "q4", "q6"]  # any row column


def test_dedup_near_duplicates_by_threshold(tmp_path):
    tasks = _tasks(tmp_path)
    assert _ids(dedup(tasks, threshold=0.9)) == ["q0", "q2", "q4", "q5", "q6", "q7", "q8"]  # q3 ~ q2 (0.95)
    # a constant template prefix inflates similarity: it is why the raw column can be the key
    templated = _tasks(tmp_path, template="Solve the following problem and put the answer in a box: {prompt}")
    assert len(dedup(templated, threshold=0.6)) < len(dedup(templated, threshold=0.6, key="question")) == 7


def test_dedup_keeps_tasks_without_the_text_and_rejects_a_key_no_task_has(tmp_path):
    tasks = _tasks(tmp_path)
    assert _ids(dedup(tasks, key="meta")) == _ids(tasks)  # only q2 has "meta": nothing to compare
    with pytest.raises(ValueError, match=r"key='qestion'.*first row has: answer, id, question, source"):
        dedup(tasks, key="qestion")
    with pytest.raises(ValueError, match=r"dedup: threshold=1\.5"):
        dedup(tasks, threshold=1.5)


def test_length_filter_bounds_are_inclusive(tmp_path):
    tasks = _tasks(tmp_path)  # lengths: q0 17, q1 18, q6 5, q7 25
    assert _ids(length_filter(tasks, min_chars=17, max_chars=25)) == ["q0", "q1", "q7"]
    assert _ids(length_filter(tasks, max_chars=5)) == ["q6"]
    assert _ids(length_filter(tasks, min_chars=100)) == ["q2", "q3"]
    assert _ids(length_filter(tasks, min_chars=2, max_chars=2, key="answer")) == ["q2", "q3", "q6", "q8"]
    with pytest.raises(ValueError, match="max_chars=3 is below min_chars=4"):
        length_filter(tasks, min_chars=4, max_chars=3)
    with pytest.raises(ValueError, match="min_chars=-1"):
        length_filter(tasks, min_chars=-1)


def test_language_filter_drops_german_and_french_keeps_short_arithmetic(tmp_path):
    tasks = _tasks(tmp_path)
    # q4 (German) and q5 (French) go; q6 "12+7=" and q7 (10 letters, which langdetect calls Danish)
    # have fewer than 20 letters and are kept unjudged
    assert _ids(language_filter(tasks)) == ["q0", "q1", "q2", "q3", "q6", "q7", "q8"]
    assert _ids(language_filter(tasks, min_chars=5)) == ["q0", "q1", "q2", "q3", "q6", "q8"]  # now q7 is judged
    # q0, q1 ("What is 2 plus 3?": 10 letters) are short too, so they stay whatever the languages
    assert _ids(language_filter(tasks, languages="de")) == ["q0", "q1", "q4", "q6", "q7"]  # a code as a string
    assert _ids(language_filter(tasks, languages=["de", "fr"], min_chars=10)) == ["q4", "q5", "q6"]
    with pytest.raises(ValueError, match=r"unknown codes \['english'\]"):
        language_filter(tasks, languages=["english"])


def test_cleaned_paths():
    cleaned, report = cleaned_paths("/runs/r1", "grpo", "/data/gsm8k/train.parquet")
    assert cleaned == "/runs/r1/data/grpo/train.cleaned.jsonl"
    assert report == "/runs/r1/data/grpo/train.report.json"
    with pytest.raises(ValueError, match="stage name"):
        cleaned_paths("/runs/r1", "a/b", "x.jsonl")


SPECS = [("dedup", {}), ("dedup", {"threshold": 0.9, "key": "question"}), ("language_filter", {}),
         ("length_filter", {"min_chars": 6})]


def test_apply_writes_report_and_cleaned_rows(tmp_path):
    tasks = _tasks(tmp_path)
    cleaned, report_path = cleaned_paths(str(tmp_path / "run"), "grpo", str(tmp_path / "train.jsonl"))
    kept, report = apply_task_operators(tasks, SPECS, "train.jsonl", cleaned_path=cleaned, report_path=report_path)
    assert _ids(kept) == ["q0", "q2", "q7", "q8"]
    assert report["source"] == "train.jsonl" and report["rows_in"] == 9 and report["rows_out"] == 4
    ops = report["operators"]
    assert [(o["name"], o["in"], o["out"], o["dropped"]) for o in ops] == [
        ("dedup", 9, 8, 1), ("dedup", 8, 7, 1), ("language_filter", 7, 5, 2), ("length_filter", 5, 4, 1)]
    assert report["rows_in"] - report["rows_out"] == sum(o["dropped"] for o in ops)
    assert ops[0]["options"] == {"threshold": 1.0, "key": "prompt", "num_perm": 128}  # defaults filled in
    assert ops[2]["examples"] == [{"task_id": "q4", "text": ROWS[4]["question"]},
                                  {"task_id": "q5", "text": ROWS[5]["question"]}]
    assert ops[1]["examples"] == [{"task_id": "q3", "text": ROWS[3]["question"][:120]}]
    with open(report_path, encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(report))
    with open(cleaned, encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == [ROWS[0], ROWS[2], ROWS[7], ROWS[8]]  # verbatim, in order
    again, _ = read_taskset(cleaned, "question", "answer", id_key="id")
    assert [(t.task_id, t.prompt, t.answer) for t in again] == [(t.task_id, t.prompt, t.answer) for t in kept]
    assert sorted(os.listdir(os.path.dirname(cleaned))) == ["train.cleaned.jsonl", "train.report.json"]  # no .tmp


def test_apply_without_operators_or_paths(tmp_path):
    tasks = _tasks(tmp_path)
    kept, report = apply_task_operators(tasks, [], "train.jsonl")
    assert kept == tasks and report == {"source": "train.jsonl", "rows_in": 9, "rows_out": 9, "operators": []}


def test_user_operator_by_dotted_path(tmp_path, monkeypatch):
    (tmp_path / "my_task_ops.py").write_text(
        "def by_source(tasks, sources=('a',), **extra):\n"
        "    return [t for t in tasks if t.row['source'] in sources]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = _tasks(tmp_path)
    kept, report = apply_task_operators(tasks, [("my_task_ops.by_source", {"sources": ["b", "d"], "note": 1}),
                                                ("dedup", {"threshold": 0.9})], "train.jsonl")
    assert _ids(kept) == ["q2", "q6", "q7", "q8"]
    assert report["operators"][0]["options"] == {"sources": ["b", "d"], "note": 1}
    assert report["operators"][0]["dropped"] == 4 and report["operators"][1]["dropped"] == 1  # q3 ~ q2


def _bad_ops(tmp_path, monkeypatch) -> None:
    (tmp_path / "bad_task_ops.py").write_text(
        "import dataclasses\n"
        "def not_a_list(tasks):\n    return tuple(tasks)\n"
        "def made_up(tasks):\n    return tasks[:1] + [dataclasses.replace(tasks[1], prompt='new')]\n"
        "def reordered(tasks):\n    return list(reversed(tasks))\n"
        "def repeated(tasks):\n    return tasks + tasks[:1]\n"
        "def in_place(tasks):\n    tasks.append(tasks[0])\n    return tasks\n"
        "def wrong_signature(rows):\n    return rows\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("name, message", [
    ("bad_task_ops.not_a_list", r"\(bad_task_ops.not_a_list\) returned a tuple"),
    ("bad_task_ops.made_up", r"\(bad_task_ops.made_up\) returned item 1 .* not one of its input tasks"),
    ("bad_task_ops.reordered", r"\(bad_task_ops.reordered\) returned its tasks out of order"),
    ("bad_task_ops.repeated", r"\(bad_task_ops.repeated\) returned its tasks out of order or repeated"),
    ("bad_task_ops.in_place", r"\(bad_task_ops.in_place\) returned its tasks out of order or repeated"),
    ("bad_task_ops.wrong_signature", r"data.operators\[1\]: task operator 'bad_task_ops.wrong_signature' has "
                                     r"signature \(rows\)"),
    ("dedupe", r"data.operators\[1\]: unknown task operator 'dedupe'; known: dedup, language_filter"),
])
def test_operators_that_do_more_than_drop_are_refused(tmp_path, monkeypatch, name, message):
    _bad_ops(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=message):
        apply_task_operators(_tasks(tmp_path), [("length_filter", {}), (name, {})], "train.jsonl")


@pytest.mark.parametrize("spec, message", [
    (("dedup", {"treshold": 0.9}), r"data.operators\[0\] \(dedup\): unknown option 'treshold'; it takes: "
                                   r"threshold, key, num_perm"),
    (("dedup", {"threshold": 0}), r"data.operators\[0\] \(dedup\): dedup: threshold=0 must be"),
    (("dedup", {"threshold": 0.99}), r"\(dedup\): dedup: threshold=0.99 with num_perm=128.*raise num_perm"),
    (("length_filter", {"max_chars": "10"}), r"\(length_filter\): length_filter: max_chars='10'"),
    (("language_filter", {"languages": []}), r"\(language_filter\): language_filter: languages=\[\]"),
    (("language_filter", {"key": "nope"}), r"\(language_filter\): language_filter: key='nope'"),
    (["dedup"], r"data.operators\[0\] is \['dedup'\]; each operator is a \(name, options\) pair"),
])
def test_wrong_options_name_the_operator_and_option(tmp_path, spec, message):
    with pytest.raises(ValueError, match=message):
        apply_task_operators(_tasks(tmp_path), [spec], "train.jsonl")


def test_dropping_every_task_names_the_operator_and_report(tmp_path):
    cleaned, report_path = cleaned_paths(str(tmp_path / "run"), "sft", "train.jsonl")
    os.makedirs(os.path.dirname(cleaned))
    with open(cleaned, "w") as f:
        f.write('{"stale": "from an earlier attempt"}\n')
    with pytest.raises(ValueError, match=r"data.operators\[1\] \(length_filter\) dropped the last 2 tasks of "
                                         r"train.jsonl.*" + str(report_path)):
        apply_task_operators(_tasks(tmp_path), [("length_filter", {"min_chars": 100}),
                                                ("length_filter", {"max_chars": 10})],
                             "train.jsonl", cleaned_path=cleaned, report_path=report_path)
    with open(report_path, encoding="utf-8") as f:
        report = json.load(f)
    assert report["rows_out"] == 0 and [o["dropped"] for o in report["operators"]] == [7, 2]
    assert not os.path.exists(cleaned)


def test_empty_input_is_refused():
    with pytest.raises(ValueError, match="no tasks"):
        apply_task_operators([], [], "train.jsonl")


def test_same_files_in_another_process_with_another_hash_seed(tmp_path):
    """Every rank cleans the taskset itself: the files must come out byte-identical."""
    rows = ROWS + [dict(r, id=f"{r['id']}b", question=r["question"].upper() + " ") for r in ROWS]
    rows += [{"id": f"t{n}", "question": f"Tom has {n} apples and gives {n % 5} away. How many are left?",
              "answer": str(n - n % 5), "source": "e"} for n in range(30)]
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    specs = [("dedup", {"threshold": 0.8}), ("language_filter", {"min_chars": 5})]
    code = ("import json, sys\nfrom rft.data.taskset import read_taskset\n"
            "from rft.data.task_operators import apply_task_operators\n"
            "src, out, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
            "tasks, _ = read_taskset(src, 'question', 'answer', id_key='id')\n"
            "apply_task_operators(tasks, specs, 'train.jsonl', out + '/c.jsonl', out + '/r.json')\n")
    tasks, _ = read_taskset(str(source), "question", "answer", id_key="id")
    apply_task_operators(tasks, specs, "train.jsonl", str(tmp_path / "here/c.jsonl"), str(tmp_path / "here/r.json"))
    env = {**os.environ, "PYTHONHASHSEED": "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1",
           "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code, str(source), str(tmp_path / "there"), json.dumps(specs)], env=env,
                   cwd=ROOT, check=True, timeout=60)
    for name in ("c.jsonl", "r.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()
    report = json.loads((tmp_path / "here/r.json").read_bytes())
    assert report["operators"][0]["dropped"] >= len(ROWS)  # at least the upper-case copies went
    assert report["operators"][1]["dropped"] == 3  # German, French, and "Solve for x" (judged: min_chars=5)


def test_tasks_are_not_modified(tmp_path):
    tasks = _tasks(tmp_path)
    before = [dataclasses.asdict(t) for t in tasks]
    apply_task_operators(tasks, SPECS, "train.jsonl")
    assert [dataclasses.asdict(t) for t in tasks] == before
