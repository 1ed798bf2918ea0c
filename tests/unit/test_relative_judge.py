"""Relative judging (rft/explorer/relative_judge.py, the `relative_judge` reward): the prompt a group
makes, what the parser reads out of realistic and broken replies, the fallback to the group's mean,
and the whole path (RewardScorer -> reward -> JudgeClient -> HTTP) against a real OpenAI-compatible
server that answers fixed text, a silent one (a hung judge) and a closed port (a dead one)."""

from __future__ import annotations

import importlib
import json
import time

import pytest

from rft.buffer.experience import Experience
from rft.config import JudgeConfig
from rft.config.checks import validate
from rft.data.taskset import Task
from rft.explorer.judge import JudgeClient, JudgeEndpoint, judge
from rft.explorer.relative_judge import (
    DEFAULT_RUBRIC,
    NEUTRAL_SCORE,
    filled,
    parse_scores,
    relative_prompt,
    rubric_text,
)
from rft.explorer.rewards import REWARDS, RewardScorer
from tests.openai_stub import OpenAIStub
from tests.unit.test_config import compose_cfg
from tests.unit.test_judge import _closed_port_url, _silent_server

TASK = Task(0, "Write a haiku about rain.", None)


def answers(*texts: str) -> list[Experience]:
    return [Experience([], [], [], 0, response=t) for t in texts]


# ---- the prompt ----------------------------------------------------------------------------------

def test_the_prompt_numbers_the_candidates_after_the_task_and_its_reference():
    instructions, body = relative_prompt(Task(3, "12+34=", "46"), ["46", "47\nor so"], "be strict")
    assert "be strict" in instructions and '"score"' in instructions and "between 0 and 1" in instructions
    assert body.index("12+34=") < body.index("Reference answer") < body.index('<candidate id="1">\n46\n</candidate>')
    assert body.index('<candidate id="1">') < body.index('<candidate id="2">\n47\nor so\n</candidate>')
    _, without = relative_prompt(TASK, ["a"], "r")
    assert "Reference" not in without  # a task without an answer (open-ended) shows none


def test_the_rubric_is_the_builtin_text_or_a_file(tmp_path):
    assert rubric_text(None) == DEFAULT_RUBRIC
    assert rubric_text("  only rhymes count \n") == "only rhymes count"
    path = tmp_path / "rubric.md"
    path.write_text("- prefer short poems\n")
    assert rubric_text(str(path)) == "- prefer short poems"


# ---- reading the reply ---------------------------------------------------------------------------

@pytest.mark.parametrize("reply, n, expected", [
    ('{"scores": [{"id": 1, "explanation": "vivid", "score": 0.9}, {"id": 2, "explanation": "flat", "score": 0.2}]}',
     2, [0.9, 0.2]),
    # prose and a fence around it, ids as strings and out of order, a number as a string
    ('Here is my grading.\n```json\n{"scores": [{"id": "2", "score": "0.25"}, {"id": "1", "score": 1}]}\n```\n'
     "Let me know {if} you need more.", 2, [1.0, 0.25]),
    ('[{"candidate": "candidate 2", "score": 0.4}, {"candidate": "candidate 1", "score": 0.6}]', 2, [0.6, 0.4]),
    ('{"1": 0.3, "2": {"score": 0.7}}', 2, [0.3, 0.7]),
    ("[0.1, 0.5, 0.9]", 3, [0.1, 0.5, 0.9]),  # a bare list of the right length: in order
    ('{"id": 1, "score": 0.8}', 1, [0.8]),  # a group of one
    # cut off by the token limit: the finished entries still count
    ('{"scores": [{"id": 1, "explanation": "good, uses {rain}", "score": 0.9}, {"id": 2, "explanation": "b', 2,
     [0.9, None]),
    ('{"scores": [{"score": 0.3, "id": 2}, {"score": 0.6, "id": 1},]}', 2, [0.6, 0.3]),  # trailing comma
    ("Candidate 1: 0.8\ncandidate #2 = 0.4\n3) score 0.5", 3, [0.8, 0.4, 0.5]),  # no JSON at all
])
def test_scores_are_read_from_json_then_fragments_then_lines(reply, n, expected):
    assert parse_scores(reply, n) == expected


@pytest.mark.parametrize("reply, n, expected", [
    ("[0.2, 0.9]", 3, [None, None, None]),  # wrong count without ids: which is which is unknown
    ('{"scores": [{"score": 0.2}, {"score": 0.9}]}', 3, [None, None, None]),
    ('{"scores": [{"id": 1, "score": 7}, {"id": 2, "score": 0.5}, {"id": 3, "score": -0.1}]}', 3, [None, 0.5, None]),
    ('{"scores": [{"id": 1, "score": true}, {"id": 2, "score": NaN}, {"id": 9, "score": 0.5}]}', 2, [None, None]),
    ('{"scores": [{"id": 1, "score": 0.2}, {"id": 1, "score": 0.9}]}', 2, [0.2, None]),  # the first score holds
    ("the first one is better than the second", 2, [None, None]),
    ("", 2, [None, None]),
    ("izq 12 = xx. = 4\n\n3 45 e", 2, [None, None]),  # what the tiny quickstart judge writes
])
def test_what_is_not_a_score_in_range_is_missing(reply, n, expected):
    assert parse_scores(reply, n) == expected


def test_missing_scores_take_the_mean_of_the_others_or_the_neutral_score():
    assert filled([0.2, None, 0.6, None]) == pytest.approx([0.2, 0.4, 0.6, 0.4])
    assert filled([None, None]) == [NEUTRAL_SCORE, NEUTRAL_SCORE]
    assert filled([0.0, 1.0]) == [0.0, 1.0]


# ---- the whole path against a real HTTP server ---------------------------------------------------

def _Judge(reply: str) -> OpenAIStub:
    """An OpenAI-compatible server that answers every chat or completion call with `reply`."""

    def respond(path: str, body: dict) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                  if path.endswith("/chat/completions") else
                  {"index": 0, "text": reply, "finish_reason": "stop", "logprobs": None})
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice]}

    return OpenAIStub(respond)


@pytest.fixture
def connect():
    """Make `judge` (what rewards import) reach `url`, as the explorer does at start."""
    def make(url: str, **cfg) -> JudgeClient:
        judge.client = JudgeClient([JudgeEndpoint(url, "token", "judge")], JudgeConfig(**cfg))
        return judge.client

    yield make
    judge.client = None


def score(group: list[Experience], task: Task = TASK, timeout_s: float = 10) -> list[float]:
    with RewardScorer("relative_judge", timeout_s=timeout_s) as scorer:
        assert scorer.group and scorer.is_async
        return scorer.score(group, [task] * len(group))


def test_a_group_is_one_chat_call_and_identical_answers_are_one_candidate(connect):
    server = _Judge('Sure.\n{"scores": [{"id": 1, "explanation": "a", "score": 0.2}, '
                    '{"id": 2, "explanation": "b", "score": 0.9}]}')
    client = connect(server.url, relative_max_new_tokens=300, rubric="prefer rain")
    try:
        assert score(answers("drip drop", "grey sky weeps\nslow", "drip drop ")) == [0.2, 0.9, 0.2]
    finally:
        server.close()
    ((path, body),) = server.requests
    assert path == "/v1/chat/completions" and body["max_tokens"] == 300 and body["temperature"] == 0.0
    system, user = body["messages"]
    assert system["role"] == "system" and "prefer rain" in system["content"]
    assert user["content"].count("<candidate id=") == 2 and "Write a haiku about rain." in user["content"]
    counts = client.take_counts()
    assert (counts.calls, counts.timeouts, counts.errors, counts.parse_failures) == (1, 0, 0, 0)


def test_without_a_chat_template_the_judge_gets_one_plain_prompt(connect):
    server = _Judge(' {"scores": [0.5, 1.0]}')
    connect(server.url, chat_template=False)
    try:
        assert score(answers("46", "47"), Task(0, "12+34=", "46")) == [0.5, 1.0]
    finally:
        server.close()
    ((path, body),) = server.requests
    assert path == "/v1/completions" and body["prompt"].endswith("JSON:") and "Reference answer" in body["prompt"]


@pytest.mark.parametrize("reply, expected, unparsed", [
    ("izq 12 = xx. = 4", [NEUTRAL_SCORE] * 3, 1),  # nothing parsed: one constant, no advantage
    ('{"scores": [{"id": 1, "score": 0.1}, {"id": 2, "score": 0.7}, {"id": 3, "explanation": "cut', [0.1, 0.7, 0.4], 1),
    ('{"scores": [{"id": 1, "score": 0.1}, {"id": 2, "score": 0.7}, {"id": 3, "score": 0.0}]}', [0.1, 0.7, 0.0], 0),
])
def test_a_reply_that_does_not_parse_scores_the_groups_mean_and_is_counted(connect, reply, expected, unparsed):
    server = _Judge(reply)
    client = connect(server.url)
    try:
        assert score(answers("a", "b", "c")) == pytest.approx(expected)
    finally:
        server.close()
    counts = client.take_counts()
    assert (counts.calls, counts.parse_failures, counts.errors) == (1, unparsed, 0)
    assert counts.scalars()["judge/parse_failures"] == unparsed


def test_a_hung_judge_costs_its_timeout_and_a_count_not_the_step(connect):
    importlib.import_module("openai")  # before the clock: its first import took 2-6 s on 2 loaded cores
    server, url = _silent_server()
    client = connect(url, timeout_s=0.5)
    started = time.monotonic()
    try:
        with RewardScorer("relative_judge", timeout_s=10) as scorer:
            rewards = scorer.score(answers("a", "b"), [TASK, TASK])
            assert (scorer.errors, scorer.timeouts) == (0, 0)  # no verdict, not a failed reward
    finally:
        server.close()
    # the judge's 0.5 s timeout, not the reward's 10: 0.505 s measured (2 cores under load), the bound
    # 10 x that and half the reward's timeout
    assert rewards == [NEUTRAL_SCORE, NEUTRAL_SCORE] and time.monotonic() - started < 5
    counts = client.take_counts()
    assert (counts.calls, counts.timeouts, counts.parse_failures) == (1, 1, 0)


def test_a_dead_judge_is_an_error_counted(connect):
    client = connect(_closed_port_url(), timeout_s=5)
    assert score(answers("a", "b")) == [NEUTRAL_SCORE, NEUTRAL_SCORE]
    counts = client.take_counts()
    assert (counts.calls, counts.errors) == (1, 1)


# ---- the group contract --------------------------------------------------------------------------

def ranks_by_length(group, task):
    """A user's group reward (run in the scorer's child process): the longest answer of the task wins."""
    longest = max(len(t.response) for t in group)
    return [float(len(t.response) == longest) + (task.index if task.answer == "offset" else 0) for t in group]


def test_a_group_reward_gets_the_group_and_its_one_task():
    name = f"{__name__}.ranks_by_length"
    assert REWARDS.variant(REWARDS.resolve(name)) == "group"
    assert "group form fn(group, task)" in REWARDS.signature
    with RewardScorer(name, timeout_s=5) as scorer:
        assert scorer.group and scorer.batch and not scorer.is_async
        task = Task(5, "q", "offset")
        assert scorer.score(answers("ab", "abc", "a"), [task] * 3) == [5.0, 6.0, 5.0]
        with pytest.raises(ValueError, match="one group at a time"):
            scorer.score(answers("a", "b"), [Task(0, "q", None), Task(1, "q", None)])


# ---- launch checks -------------------------------------------------------------------------------

def _judge_dir(tmp_path, positions: int = 4096) -> str:
    """An HF model directory as the checks see it: its config.json."""
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return str(tmp_path / "judge")


def test_a_relative_judge_stage_with_a_judge_that_fits_validates(tmp_path):
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "cluster.judge_ranks=1",
                      "+stages.1.algorithm.reward=relative_judge", f"judge.model={_judge_dir(tmp_path)}")
    validate(cfg)


@pytest.mark.parametrize("overrides, key", [
    ([], r"stages\[grpo\]\.algorithm\.reward.*cluster\.judge_ranks=1"),
    (["cluster.judge_ranks=1", "judge.chat_template=false"],  # the tiny policy as judge: 64 positions
     r"judge\.relative_max_new_tokens.*context holds 64 tokens"),
    (["cluster.judge_ranks=1", "judge.relative_max_new_tokens=16"], r"judge\.chat_template.*model\.chat_template=false"),
    (["cluster.judge_ranks=1", "judge.model=JUDGE", "judge.rubric=rubrics/missing.md"], r"judge\.rubric.*no such file"),
    (["cluster.judge_ranks=1", "judge.model=JUDGE", "judge.relative_max_new_tokens=0"],
     r"judge\.relative_max_new_tokens.*1 or more"),
    (["cluster.judge_ranks=1", "judge.model=JUDGE", "+stages.1.algorithm.group_size=1"],
     r"stages\[grpo\]\.algorithm\.group_size.*2 or more"),
])
def test_bad_relative_judge_settings_name_the_key(tmp_path, overrides, key):
    overrides = [o.replace("JUDGE", _judge_dir(tmp_path)) if "JUDGE" in o else o for o in overrides]
    cfg = compose_cfg("+experiment=quickstart", f"run.output_dir={tmp_path}", "+stages.1.algorithm.reward=relative_judge",
                      *overrides)
    with pytest.raises(ValueError, match=key):
        validate(cfg)

