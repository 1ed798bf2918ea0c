"""Relative judging (RULER-style): a task's whole group of answers goes to the judge in one prompt,
and one score per answer comes back (the `relative_judge` reward, rft/explorer/rewards.py).

    prompt  = instructions + rubric (judge.rubric) + the task (+ its reference answer, if any)
              + the group's distinct answers as candidates 1..k
    answer  = {"scores": [{"id": 1, "explanation": "...", "score": 0.8}, ...]}
    scores  = parse_scores(answer, k): JSON first, then `"id": 1 ... "score": 0.8` fragments (a
              reply cut off by judge.relative_max_new_tokens), then `1: 0.8` lines
    missing = the mean of the scores that parsed; none parsed (or the call timed out or failed):
              NEUTRAL_SCORE for every member

Why relative: GRPO only uses differences within a group, and a judge ranks answers it sees side
by side more consistently than it scores one answer alone (OpenPipe ART's RULER, which this
follows; its prompt and parser are not copied). Identical answers are shown once, so they score
alike by construction and a group of one answer is judged on its own.

The fallback gives no signal, by design: a member the judge did not score gets the mean of the
group's parsed scores, so under GRPO its advantage is exactly zero while the others keep their
ranking; a group with no parsed score gets one constant for all, zero advantage again. The
constant is 0.5, the middle of the judge's scale, not 0: advantages that do not centre per group
(reinforce_pp, gae) would read 0 as a verdict. A reply that did not score every candidate counts
once in judge/parse_failures; a call that timed out or failed counts in judge/timeouts or
judge/errors (rft/explorer/judge.py), never fails the step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any

from rft.explorer.judge import JudgeClient, JudgeError

if TYPE_CHECKING:
    from rft.buffer.experience import Experience
    from rft.data.taskset import Task

NEUTRAL_SCORE = 0.5  # every member's score when the judge gave none (see above)

DEFAULT_RUBRIC = """\
- An answer that does what the task asks scores well above one that does not.
- Among answers that do it, a clearer, more direct and more complete one scores higher.
- Partial progress towards the goal earns partial credit.
- Keep score gaps proportional to quality gaps: near-equal answers get near-equal scores."""

INSTRUCTIONS = """\
You are grading several candidate answers to the same task. Compare them with each other and give \
each a score between 0 and 1.

Grading standards:
{rubric}

Reply with JSON only, one entry per candidate, in this form:
{{"scores": [{{"id": 1, "explanation": "<one sentence>", "score": <0 to 1>}}, ...]}}"""


@functools.lru_cache(maxsize=8)
def rubric_text(rubric: str | None) -> str:
    """judge.rubric as text: the built-in rubric (None), a text file's contents, or the text itself.
    Read once per rank (cached): the file is read where the reward runs, as judge.model is."""
    if rubric is None:
        return DEFAULT_RUBRIC
    if os.path.isfile(rubric):
        with open(rubric) as f:
            return f.read().strip()
    return rubric.strip()


def looks_like_path(rubric: str) -> bool:
    """One word with a slash or a text-file suffix: meant as a file, so a missing one is a mistake
    (the launch check names it) rather than a one-line rubric."""
    return not any(c.isspace() for c in rubric.strip()) and ("/" in rubric or rubric.endswith((".txt", ".md")))


def relative_prompt(task: Task, candidates: list[str], rubric: str) -> tuple[str, str]:
    """(instructions, the task and its candidates): a system and a user message for a chat judge,
    joined into one prompt for a plain completion."""
    parts = [f"Task:\n{(task.prompt or '').strip()}"]
    if task.answer is not None:
        parts.append(f"Reference answer (for judging correctness):\n{task.answer.strip()}")
    parts.append("Candidates:\n" + "\n\n".join(f'<candidate id="{k}">\n{text}\n</candidate>'
                                               for k, text in enumerate(candidates, start=1)))
    return INSTRUCTIONS.format(rubric=rubric), "\n\n".join(parts)


# ---- reading the judge's reply -----------------------------------------------------------------

_ID_KEYS = ("id", "candidate", "candidate_id", "trajectory_id", "index")
# an object's id and score, in either order, within one {...} without nesting: what is left of a
# JSON reply cut off by the token limit or broken by a trailing comma
_FRAGMENT = re.compile(r'\{[^{}]*?"(?:id|candidate(?:_id)?|trajectory_id|index)"\s*:\s*"?(\d+)"?[^{}]*?'
                       r'"score"\s*:\s*"?([-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)')
_FRAGMENT_SCORE_FIRST = re.compile(r'\{[^{}]*?"score"\s*:\s*"?([-+]?\d*\.?\d+(?:[eE][-+]?\d+)?)"?[^{}]*?'
                                   r'"(?:id|candidate(?:_id)?|trajectory_id|index)"\s*:\s*"?(\d+)')
# a line "1: 0.8", "Candidate 2 = 0.4", "3) 0.5", "candidate #1: score 0.9"
_LINE = re.compile(r"^\W*(?:candidate|answer)?\s*#?(\d+)\s*[:=)\]-]+\s*(?:score\s*[:=]?\s*)?([-+]?\d*\.?\d+)\s*$",
                   re.IGNORECASE | re.MULTILINE)


def parse_scores(reply: str, n: int) -> list[float | None]:
    """The score of candidates 1..n in the judge's reply; None where it gave none in [0, 1].

    Scores outside [0, 1] are dropped, not clipped: a judge grading on another scale (0-10) would
    otherwise tie every good answer at 1. A list without ids counts only if it has exactly n
    entries (which is which is unknown otherwise)."""
    entries: dict[int, Any] = {}
    for value in _json_values(reply):
        if isinstance(value, dict) and "score" in value and "scores" not in value:
            # one candidate's entry on its own: a group of one, or a list broken around it
            found_id = _as_id(next((value[k] for k in _ID_KEYS if k in value), 1 if n == 1 else None))
            if found_id is not None:
                entries.setdefault(found_id, value["score"])
            continue
        found = _from_json(value, n)
        if found is not None:
            return _checked(found, n)
    if entries:
        return _checked(entries, n)
    pairs = [(int(i), s) for i, s in _FRAGMENT.findall(reply)]
    pairs += [(int(i), s) for s, i in _FRAGMENT_SCORE_FIRST.findall(reply)]
    if not pairs:
        pairs = [(int(i), s) for i, s in _LINE.findall(reply)]
    return _checked(_by_id(pairs), n)


def _json_values(reply: str):
    """Every JSON object or array in the reply, outermost first (a reply may wrap its JSON in
    prose or a ``` fence)."""
    decoder = json.JSONDecoder()
    position = 0
    while (start := _next_opening(reply, position)) >= 0:
        try:
            value, end = decoder.raw_decode(reply, start)
        except json.JSONDecodeError:
            position = start + 1
            continue
        yield value
        position = end


def _next_opening(text: str, start: int) -> int:
    found = [i for i in (text.find("{", start), text.find("[", start)) if i >= 0]
    return min(found, default=-1)


def _from_json(value: Any, n: int) -> dict[int, Any] | None:
    """{candidate id: score} from a decoded reply, or None if it is not a reply of scores."""
    if isinstance(value, dict):
        if "scores" in value:
            return _from_json(value["scores"], n)
        if value and all(str(k).strip().isdigit() for k in value):  # {"1": 0.8, "2": 0.3}
            return {int(k): (v.get("score") if isinstance(v, dict) else v) for k, v in value.items()}
        return None
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(e, dict) and "score" in e for e in value):
        ids = [next((e[k] for k in _ID_KEYS if k in e), None) for e in value]
        if all(_as_id(i) is not None for i in ids):
            return _by_id([(_as_id(i), e["score"]) for i, e in zip(ids, value)])
        return dict(enumerate((e["score"] for e in value), start=1)) if len(value) == n else None
    if all(_number(e) is not None for e in value):  # [0.8, 0.3]
        return dict(enumerate(value, start=1)) if len(value) == n else None
    return None


def _as_id(value: Any) -> int | None:
    """A candidate id: 3, "3", "candidate 3"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    digits = re.search(r"\d+", value) if isinstance(value, str) else None
    return int(digits.group()) if digits else None


def _by_id(pairs: list[tuple[int, Any]]) -> dict[int, Any]:
    scores: dict[int, Any] = {}
    for k, score in pairs:
        scores.setdefault(k, score)  # the first score given for a candidate holds
    return scores


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _checked(found: dict[int, Any], n: int) -> list[float | None]:
    scores: list[float | None] = []
    for k in range(1, n + 1):
        number = _number(found.get(k))
        scores.append(number if number is not None and 0.0 <= number <= 1.0 else None)
    return scores


def filled(scores: list[float | None]) -> list[float]:
    """Each missing score as the mean of those present; NEUTRAL_SCORE for all if none is."""
    present = [s for s in scores if s is not None]
    mean = sum(present) / len(present) if present else NEUTRAL_SCORE
    return [mean if s is None else s for s in scores]


# ---- the reward's body -------------------------------------------------------------------------

async def judge_group(group: list[Experience], task: Task, client: JudgeClient) -> list[float]:
    """One score per member of `group` (one task's samples) from one call to the judge."""
    cfg = client.cfg
    texts = [e.response.strip() for e in group]
    candidates = list(dict.fromkeys(texts))  # identical answers: one candidate, one score
    instructions, body = relative_prompt(task, candidates, rubric_text(cfg.rubric))
    length = cfg.relative_max_new_tokens
    try:
        if cfg.chat_template:
            reply = await client.chat([{"role": "system", "content": instructions}, {"role": "user", "content": body}],
                                      max_new_tokens=length)
        else:
            reply = await client.complete(f"{instructions}\n\n{body}\n\nJSON:", max_new_tokens=length)
    except JudgeError:  # timed out or failed: counted by the client, scored as no verdict
        return [NEUTRAL_SCORE] * len(group)
    scores = parse_scores(reply, len(candidates))
    if None in scores:
        client.counts.parse_failures += 1
    by_text = dict(zip(candidates, filled(scores)))
    return [by_text[text] for text in texts]
