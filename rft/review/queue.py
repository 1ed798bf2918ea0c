"""The on-disk contract between a run, the person reviewing its rollouts, and the trainer.

A `review` experience operator routes a group of rollouts (one task's prompt and its sampled
responses) to `<run_dir>/review/queue/<id>.json`; the review UI appends one line per decision to
`<run_dir>/review/labels.jsonl`; the trainer reads the labels back. Everything is plain files so
that the run, the UI and the trainer may each be killed and restarted at any time:

- a queue item is written under a temporary name and renamed into place, so a reader sees a whole
  item or none, and enqueueing an id that is already there does nothing (a resumed run sends the
  same groups again);
- a label is one appended line, fsync'ed before `label` returns, so a label the UI reported as
  saved survives a crash; a line torn by a crash mid-append is ignored, and the next label starts
  on a fresh line so it is not glued to the torn one;
- a later label for the same item replaces an earlier one (a reviewer may change their mind).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import re
import time
from typing import Any

from rft.runtime.storage import fsync_dir, write_text_atomic

VERDICTS = ("scored", "skip")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME = 150  # file names stay well under the 255-byte limit of common filesystems


def queue_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "review", "queue")


def labels_path(run_dir: str) -> str:
    return os.path.join(run_dir, "review", "labels.jsonl")


def safe(item_id: str) -> str:
    """A portable file name for `item_id`. Characters outside [A-Za-z0-9._-] become '_'; when any
    were replaced (or the id was shortened) a hash of the original id is appended, so that ids
    differing only in replaced characters ("a/b", "a:b") still get different files."""
    name = _UNSAFE.sub("_", item_id)
    if name != item_id or len(name) > _MAX_NAME:
        digest = hashlib.blake2b(item_id.encode(), digest_size=6).hexdigest()
        name = f"{name[:_MAX_NAME]}-{digest}"
    return name


def _item_path(run_dir: str, item_id: str) -> str:
    return os.path.join(queue_dir(run_dir), safe(item_id) + ".json")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checked_item(item: Any) -> dict:
    """A copy of `item` with `metrics` defaulted, or ValueError naming the field and the fix."""
    if not isinstance(item, dict):
        raise ValueError(f"a review item must be a dict, got {type(item).__name__}")
    where = f"review item {item.get('id')!r}"
    for key, kind in (("id", str), ("reason", str), ("task_id", str), ("prompt", str)):
        if not isinstance(item.get(key), kind):
            raise ValueError(f"{where}: field {key!r} must be a string, got {item.get(key)!r}")
    if not item["id"]:
        raise ValueError("review item: field 'id' is empty; give each group a unique, stable id")
    if not isinstance(item.get("step"), int) or isinstance(item.get("step"), bool):
        raise ValueError(f"{where}: field 'step' must be an int (the trainer step), got {item.get('step')!r}")
    responses, experiences = item.get("responses"), item.get("experiences")
    if not isinstance(responses, list) or not responses:
        raise ValueError(f"{where}: field 'responses' must be a non-empty list of "
                         "{'text', 'reward', 'metrics'} dicts")
    checked = []
    for n, r in enumerate(responses):
        if not isinstance(r, dict) or not isinstance(r.get("text"), str) or not _is_number(r.get("reward")):
            raise ValueError(f"{where}: responses[{n}] needs 'text' (str) and 'reward' (number), got {r!r:.200}")
        metrics = r.get("metrics", {})
        if not isinstance(metrics, dict):
            raise ValueError(f"{where}: responses[{n}].metrics must be a dict, got {metrics!r:.200}")
        checked.append({**r, "metrics": metrics})
    if not isinstance(experiences, list) or not all(isinstance(e, dict) for e in experiences):
        raise ValueError(f"{where}: field 'experiences' must be a list of dicts (the training rows)")
    if len(experiences) != len(responses):
        raise ValueError(f"{where}: 'experiences' has {len(experiences)} rows but 'responses' has "
                         f"{len(responses)}; pass one training row per response, in the same order")
    return {**item, "responses": checked}


def enqueue(run_dir: str, item: dict) -> str | None:
    """Put `item` in the review queue. Returns its path, or None when an item with this id is
    queued already (a resumed run re-enqueues the same ids; the first copy, and any label given
    to it, stands)."""
    item = _checked_item(item)
    os.makedirs(queue_dir(run_dir), exist_ok=True)
    path = _item_path(run_dir, item["id"])
    if os.path.exists(path):
        return None
    write_text_atomic(path, json.dumps(item), f"review item {item['id']!r}")
    return path


def _read_item(path: str) -> dict | None:
    try:
        with open(path) as f:
            return _checked_item(json.load(f))
    except (OSError, ValueError):  # removed meanwhile, torn by hand, or not an item at all
        return None


def item(run_dir: str, item_id: str) -> dict | None:
    """One queued item by id, or None when there is none (or it cannot be read)."""
    return _read_item(_item_path(run_dir, item_id))


def items(run_dir: str) -> list[dict]:
    """Every queued item, sorted by (step, id). Files that cannot be read as an item are skipped:
    one bad file must not hide the rest of the queue from the reviewer or the trainer."""
    qdir = queue_dir(run_dir)
    try:
        names = os.listdir(qdir)
    except OSError:
        return []
    found = [_read_item(os.path.join(qdir, n)) for n in names if n.endswith(".json")]
    return sorted((i for i in found if i is not None), key=lambda i: (i["step"], i["id"]))


def _checked_scores(item: dict, scores: Any) -> list[float | None]:
    n = len(item["responses"])
    if not isinstance(scores, (list, tuple)) or len(scores) != n:
        raise ValueError(f"label for item {item['id']!r}: scores must be a list of {n} entries "
                         f"(one per response, None for unscored), got {scores!r}")
    out: list[float | None] = []
    for k, s in enumerate(scores):
        if s is not None and not (_is_number(s) and math.isfinite(s) and 0.0 <= s <= 1.0):
            raise ValueError(f"label for item {item['id']!r}: scores[{k}]={s!r} must be None or a "
                             "number in [0, 1]")
        out.append(None if s is None else float(s))
    return out


def label(run_dir: str, item_id: str, scores: list[float | None], verdict: str, note: str = "") -> dict:
    """Record a reviewer's decision on queued item `item_id` and return the record. `scores` has
    one entry per response (None: not scored, the trainer keeps the original reward). The line is
    on disk (fsync'ed) when this returns."""
    if verdict not in VERDICTS:
        raise ValueError(f"label for item {item_id!r}: verdict={verdict!r} must be one of {VERDICTS}")
    if not isinstance(note, str):
        raise ValueError(f"label for item {item_id!r}: note must be a string, got {note!r}")
    item = _read_item(_item_path(run_dir, item_id))
    if item is None or item["id"] != item_id:
        raise ValueError(f"label for item {item_id!r}: no such item in {queue_dir(run_dir)}; "
                         "label only ids that `items()` lists")
    record = {"item": item_id, "scores": _checked_scores(item, scores), "verdict": verdict,
              "note": note, "reviewer": _reviewer(), "time": time.time()}
    _append_line(labels_path(run_dir), json.dumps(record))
    return record


def _reviewer() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no USER/LOGNAME and no passwd entry (some containers): still save the label
        return "unknown"


def _append_line(path: str, line: str) -> None:
    """Append `line` durably. If a crash left the file without a final newline, start on a fresh
    line, or the new record would be glued to the torn one and lost with it. One os.write per
    record, with O_APPEND, so two reviewers appending at once do not interleave within a line."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        lead = ""
        if size and os.pread(fd, 1, size - 1) != b"\n":
            lead = "\n"
        os.write(fd, (lead + line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if size == 0:
        fsync_dir(os.path.dirname(path))  # a new file's directory entry must survive a crash too


def labels(run_dir: str) -> dict[str, dict]:
    """The latest label per item id. Lines that do not parse (a crash mid-append tears the last
    one) are ignored."""
    out: dict[str, dict] = {}
    try:
        with open(labels_path(run_dir), "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("item"), str):
            out[record["item"]] = record
    return out


def pending(run_dir: str) -> list[dict]:
    """Queued items without a label yet, in `items` order."""
    done = labels(run_dir)
    return [i for i in items(run_dir) if i["id"] not in done]


def export(run_dir: str, kind: str, path: str, min_score: float = 0.5) -> int:
    """Write the labelled items as a jsonl taskset and return the number of rows. kind="sft": one
    row per response scored >= `min_score`; kind="dpo": one (best, worst) pair per item with two
    or more scored responses whose scores differ. Items the reviewer skipped are left out."""
    if kind not in ("sft", "dpo"):
        raise ValueError(f"export kind={kind!r} must be 'sft' or 'dpo'")
    done = labels(run_dir)
    rows: list[dict] = []
    for item in items(run_dir):
        record = done.get(item["id"])
        if record is None or record.get("verdict") != "scored":
            continue
        scores = record.get("scores") or []
        scored = [(s, r["text"]) for s, r in zip(scores, item["responses"]) if _is_number(s)]
        if kind == "sft":
            rows += [{"question": item["prompt"], "answer": text, "task_id": item["task_id"], "score": s}
                     for s, text in scored if s >= min_score]
        elif len(scored) >= 2:
            best = max(scored, key=lambda st: st[0])  # the first of equals: a stable, reproducible pick
            worst = min(scored, key=lambda st: st[0])
            if best[0] > worst[0]:
                rows.append({"question": item["prompt"], "chosen": best[1], "rejected": worst[1],
                             "task_id": item["task_id"]})
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows), f"the {kind} export")
    return len(rows)
