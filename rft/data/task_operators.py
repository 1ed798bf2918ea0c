"""Task operators: clean a taskset before a stage (deduplicate, filter by length or language).

Registry TASK_OPERATORS, signature

    fn(tasks: list[Task], **options) -> list[Task]   (the tasks kept, in order)

A stage's `data.operators` lists `(name, options)` pairs; `apply_task_operators` runs them in
order on the training taskset, writes the kept rows to `<run_dir>/data/<stage>/<name>.cleaned.jsonl`
and what each operator dropped to `<name>.report.json` (`cleaned_paths`). Every rank that reads
the taskset runs the same operators and must keep the same tasks, so operators are deterministic:
no unseeded randomness and no iteration over sets of strings (salted per process).

Operators only *drop* tasks: the result must be a subsequence of the input (the same Task objects,
in order). A task that is rewritten or made up would not match its source row in the cleaned file
or the report, so `apply_task_operators` refuses it with the operator's name. Built-ins:

- "dedup": drop tasks whose text repeats an earlier one, exactly or by MinHash similarity.
- "length_filter": keep tasks whose text is min_chars..max_chars characters long (characters, not
  tokens; rows too long for the context are handled by rft/data/context_fit.py).
- "language_filter": keep tasks whose text langdetect reads as one of `languages`.

Each reads one text per task, named by `key`: "prompt" (Task.prompt, i.e. *after*
data.prompt_template), "answer" (Task.answer) or any other column of the source row. A long
template makes all prompts look alike to "dedup" and English to "language_filter": with one, pass
the raw column (e.g. key="question"). A task without that text is kept (there is nothing to judge),
but a key that no task has is a ValueError, since it is almost surely a typo.

Scoring difficulty with a judge model is not an operator here: it needs the in-job judge engines,
which are not up yet when the taskset is cleaned; rft/data/judge_difficulty.py does it once they are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from typing import Any, Callable

from rft.data.near_duplicates import duplicate_of
from rft.data.taskset import Task
from rft.registry import Registry
from rft.runtime.storage import write_text_atomic

TASK_OPERATORS = Registry("task operator", params=("tasks",), returns="list[Task] (the tasks kept, in order)")

_EXAMPLES = 5  # dropped tasks listed per operator in the report
_EXAMPLE_CHARS = 120


def _text(task: Task, key: str) -> str | None:
    """The text `key` names, or None when the task has none. Non-string columns (numbers, lists)
    are compared as their JSON text, with sorted keys so equal objects give equal text."""
    value = task.prompt if key == "prompt" else task.answer if key == "answer" else task.row.get(key)
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _texts(tasks: list[Task], key: Any, operator: str) -> list[str | None]:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{operator}: key={key!r} must be a column name, e.g. 'prompt' or 'answer'")
    texts = [_text(t, key) for t in tasks]
    if tasks and all(t is None for t in texts):
        columns = ", ".join(sorted(map(str, tasks[0].row))[:12])
        raise ValueError(f"{operator}: key={key!r} names no text in any task; use 'prompt', 'answer' or a "
                         f"column of the rows (the first row has: {columns})")
    return texts


def _check_count(operator: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{operator}: {name}={value!r} must be a non-negative integer (characters)"
                         + (" or None for no limit" if allow_none else ""))


@TASK_OPERATORS.register("dedup")
def dedup(tasks: list[Task], threshold: float = 1.0, key: str = "prompt", num_perm: int = 128) -> list[Task]:
    """Drop each task whose text duplicates an earlier task's, keeping the first occurrence.

    threshold 1.0 compares text exactly after lowercasing and collapsing whitespace; below 1.0
    also near-duplicates by the MinHash estimate of character-3-gram Jaccard similarity
    (rft/data/near_duplicates.py: a changed number is a small change, so at 0.8 "sold 48 clips"
    and "sold 72 clips" in an otherwise equal prompt are duplicates).
    """
    texts = _texts(tasks, key, "dedup")
    present = [i for i, text in enumerate(texts) if text is not None]
    try:
        dup = duplicate_of([texts[i] for i in present], threshold=threshold, num_perm=num_perm)
    except ValueError as err:
        raise ValueError(f"dedup: {err}") from None
    dropped = {present[j] for j, d in enumerate(dup) if d is not None}
    return [t for i, t in enumerate(tasks) if i not in dropped]


@TASK_OPERATORS.register("length_filter")
def length_filter(tasks: list[Task], min_chars: int = 0, max_chars: int | None = None,
                  key: str = "prompt") -> list[Task]:
    """Keep tasks whose text has min_chars <= len(text) <= max_chars characters (as stored, not
    normalised); max_chars=None is no upper limit."""
    _check_count("length_filter", "min_chars", min_chars)
    _check_count("length_filter", "max_chars", max_chars, allow_none=True)
    if max_chars is not None and max_chars < min_chars:
        raise ValueError(f"length_filter: max_chars={max_chars} is below min_chars={min_chars}; "
                         "every task would be dropped")
    texts = _texts(tasks, key, "length_filter")
    return [t for t, text in zip(tasks, texts)
            if text is None or (min_chars <= len(text) and (max_chars is None or len(text) <= max_chars))]


@functools.lru_cache(maxsize=1)
def _language_factory():
    """langdetect's detector factory, loaded once, with profiles in sorted order and seed 0.

    langdetect samples n-grams at random: with no seed a borderline text can be read as another
    language on another rank. `DetectorFactory.seed = 0` would fix that globally; setting it on
    our own factory does the same without changing langdetect for other code in the process.
    langdetect's own loader reads the profiles in `os.listdir` order, which differs between file
    systems and changes floating-point sums near ties; loading them sorted removes that too.
    """
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    profiles = []
    for name in sorted(os.listdir(PROFILES_DIRECTORY)):
        with open(os.path.join(PROFILES_DIRECTORY, name), encoding="utf-8") as f:
            profiles.append(f.read())
    factory = DetectorFactory()
    factory.load_json_profile(profiles)
    factory.set_seed(0)
    return factory


def _language(text: str) -> str | None:
    """langdetect's best language code for `text`, or None when it finds no features to judge."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_factory().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


@TASK_OPERATORS.register("language_filter")
def language_filter(tasks: list[Task], languages: tuple[str, ...] | list[str] | str = ("en",), key: str = "prompt",
                    min_chars: int = 20) -> list[Task]:
    """Keep tasks whose text langdetect reads as one of `languages` (ISO 639-1 codes as langdetect
    names them: "en", "de", "zh-cn", ...).

    Only letters count towards `min_chars` (str.isalpha, so any script): a text with fewer is kept
    unjudged, because "12+7=" or "Solve: x^2 = 4" has no language to detect and dropping all
    formula-only prompts from a math set would be a silent disaster. A text in which langdetect
    finds no features is kept for the same reason: no evidence that it is in the wrong language.
    """
    if isinstance(languages, str):
        languages = (languages,)
    known = _language_factory().get_lang_list()
    if not isinstance(languages, (list, tuple)) or not languages:
        raise ValueError(f"language_filter: languages={languages!r} must be a non-empty list of codes, e.g. ['en']")
    unknown = [code for code in languages if code not in known]
    if unknown:
        raise ValueError(f"language_filter: languages has unknown codes {unknown}; "
                         f"langdetect knows: {', '.join(sorted(known))}")
    _check_count("language_filter", "min_chars", min_chars)
    wanted = set(languages)
    kept = []
    for task, text in zip(tasks, _texts(tasks, key, "language_filter")):
        if text is None or sum(ch.isalpha() for ch in text) < min_chars:
            kept.append(task)
            continue
        language = _language(text)
        if language is None or language in wanted:
            kept.append(task)
    return kept


def cleaned_paths(run_dir: str, stage: str, source_path: str) -> tuple[str, str]:
    """(`<run_dir>/data/<stage>/<base>.cleaned.jsonl`, `<run_dir>/data/<stage>/<base>.report.json`),
    `<base>` being the source file's name without its extension."""
    if not stage or stage in (".", "..") or "/" in stage or os.sep in stage:
        raise ValueError(f"stage name {stage!r} cannot name a directory; use a plain name such as 'grpo'")
    base = os.path.splitext(os.path.basename(source_path))[0]
    folder = os.path.join(run_dir, "data", stage)
    return os.path.join(folder, f"{base}.cleaned.jsonl"), os.path.join(folder, f"{base}.report.json")


def _options(fn: Callable[..., Any], tasks: list[Task], options: dict[str, Any], where: str) -> dict[str, Any]:
    """The options the operator will run with, its defaults filled in (for the report), or a
    ValueError naming an option it does not take."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]  # after `tasks`
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = [p.name for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    unknown = [k for k in options if k not in names and not takes_any]
    if unknown:
        raise ValueError(f"{where}: unknown option {', '.join(map(repr, unknown))}; it takes: "
                         f"{', '.join(names) or '(no options)'}")
    try:
        bound = sig.bind(tasks, **options)
    except TypeError as err:  # e.g. an option without a default that the spec leaves out
        raise ValueError(f"{where}: options {sorted(options)} do not fit its signature ({err})") from None
    bound.apply_defaults()
    effective: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            effective.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            effective[name] = value
    return effective


def _check_result(result: Any, given: list[Task], where: str) -> None:
    """ValueError unless `result` is a subsequence of `given`: the same objects, in order."""
    if not isinstance(result, list):
        raise ValueError(f"{where} returned a {type(result).__name__}; a task operator returns a list of "
                         "the tasks it keeps")
    position = 0
    for k, item in enumerate(result):
        while position < len(given) and given[position] is not item:
            position += 1
        if position == len(given):
            if any(item is t for t in given):
                raise ValueError(f"{where} returned its tasks out of order or repeated (item {k}); an operator "
                                 "keeps a subsequence of its input, in order")
            raise ValueError(f"{where} returned item {k} ({item!r:.100}), which is not one of its input tasks; an "
                             "operator may drop tasks but not create or modify them (dataclasses.replace makes "
                             "a new task)")
        position += 1


def _rows_jsonl(tasks: list[Task], source: str) -> str:
    lines = []
    for task in tasks:
        try:
            lines.append(json.dumps(task.row, ensure_ascii=False) + "\n")
        except (TypeError, ValueError) as err:  # e.g. a parquet timestamp or bytes column
            raise ValueError(f"{source}: task {task.task_id} cannot be written as JSON ({err}); cleaned tasksets "
                             "are jsonl, so convert that column to text or numbers in the source") from None
    return "".join(lines)


def apply_task_operators(tasks: list[Task], specs: list[tuple[str, dict[str, Any]]], source: str,
                         cleaned_path: str | None = None, report_path: str | None = None
                         ) -> tuple[list[Task], dict[str, Any]]:
    """Run `specs` (the stage's `data.operators`: (name or dotted path, options) pairs) in order on
    `tasks` read from `source`; return the kept tasks and the report.

    The report is {"source", "rows_in", "rows_out", "operators": [{"name", "options" (defaults
    filled in), "in", "out", "dropped", "examples": up to 5 dropped {"task_id", "text"}}]}. With
    `cleaned_path`, the kept rows (`Task.row`, verbatim, in order) are written there as jsonl; with
    `report_path`, the report as JSON; both atomically, creating folders. Raises ValueError naming
    the operator when one is unknown, gets an option it does not take, rejects an option's value,
    returns anything but a subsequence of its input, or leaves no task (the report is still
    written then, so its examples show what went).
    """
    if not tasks:
        raise ValueError(f"{source}: no tasks to run data.operators on")
    report: dict[str, Any] = {"source": source, "rows_in": len(tasks), "rows_out": len(tasks), "operators": []}
    current = list(tasks)
    for i, spec in enumerate(specs):
        if not (isinstance(spec, (list, tuple)) and len(spec) == 2 and isinstance(spec[0], str)
                and isinstance(spec[1], dict)):
            raise ValueError(f"data.operators[{i}] is {spec!r:.100}; each operator is a (name, options) pair, "
                             "e.g. ('dedup', {'threshold': 0.9})")
        name, given = spec
        where = f"data.operators[{i}] ({name})"
        try:
            fn = TASK_OPERATORS.resolve(name)
        except ValueError as err:
            raise ValueError(f"data.operators[{i}]: {err}") from None
        options = _options(fn, current, given, where)
        try:
            result = fn(list(current), **given)  # a copy: an operator that edits its list in place cannot
            # change what `current` says it was given
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        _check_result(result, current, where)
        kept = {id(t) for t in result}
        dropped = [t for t in current if id(t) not in kept]
        key = options.get("key") if isinstance(options.get("key"), str) else "prompt"
        report["operators"].append({
            "name": name, "options": options, "in": len(current), "out": len(result), "dropped": len(dropped),
            "examples": [{"task_id": t.task_id, "text": (_text(t, key) or "")[:_EXAMPLE_CHARS]}
                         for t in dropped[:_EXAMPLES]],
        })
        report["rows_out"] = len(result)
        current = result
        if not current:
            if cleaned_path and os.path.exists(cleaned_path):  # an earlier attempt's; it no longer applies
                with contextlib.suppress(FileNotFoundError):  # another rank may have removed it first
                    os.remove(cleaned_path)
            if report_path:
                write_text_atomic(report_path, json.dumps(report, indent=2, ensure_ascii=False, default=repr), "the taskset report")
            where_report = f"see {report_path}" if report_path else "no report was written (no report_path)"
            raise ValueError(f"{where} dropped the last {len(dropped)} tasks of {source}; nothing is left to "
                             f"train on ({where_report}): relax its options or remove it")
    if cleaned_path:
        write_text_atomic(cleaned_path, _rows_jsonl(current, source), "the cleaned taskset")
    if report_path:  # written after the cleaned file, so the report never describes a half-written one
        write_text_atomic(report_path, json.dumps(report, indent=2, ensure_ascii=False, default=repr), "the taskset report")
    return current, report
