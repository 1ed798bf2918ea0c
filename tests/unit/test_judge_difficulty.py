"""data.judge_difficulty (rft/data/judge_difficulty.py): the judges' numbers become the tasks'
difficulty column, replies without a number and failed calls get the median, engine 0's file is
what every engine and a resumed run read, and the config names what is wrong. The judge here is
a real HTTP server speaking OpenAI's completions API, reached through the real JudgeClient."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rft.config import JudgeConfig, JudgeDifficultyConfig, SelectorConfig
from rft.config.checks import validate
from rft.data.judge_difficulty import ask_judges, score_tasks, scores_path
from rft.data.selectors import build_selector
from rft.data.taskset import Task
from rft.explorer.judge import JudgeClient, JudgeEndpoint
from tests.unit.test_config import compose_cfg

# the judge's reply to each prompt (the template below is "{prompt}"): a number somewhere, none, or a failure
REPLIES = {"8+5=": "I'd say 7/10", "1+2=": "1", "45+55=": "difficulty: 9.5", "3+4=": "easy!", "9+9=": "SLOW"}


class _Judge(BaseHTTPRequestHandler):
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        _Judge.calls.append(prompt)
        if REPLIES.get(prompt) == "SLOW":  # this call fails: the server answers with an error
            self.send_response(500)
            self.end_headers()
            return
        payload = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "judge",
                              "choices": [{"index": 0, "text": REPLIES[prompt], "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def judges():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Judge.calls = []
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield JudgeClient([JudgeEndpoint(url, "token", "judge")], JudgeConfig(timeout_s=10))
    server.shutdown()


def _tasks() -> list[Task]:
    return [Task(index=i, prompt=p, answer=str(eval(p[:-1])), row={"question": p}) for i, p in enumerate(REPLIES)]


SETTINGS = JudgeDifficultyConfig(enabled=True, prompt="{prompt}", chat=False)


def test_the_judges_numbers_fill_the_column_and_a_resume_reads_them_without_asking(judges, tmp_path, capsys):
    tasks, path = _tasks(), scores_path(str(tmp_path), "grpo", "/data/train.jsonl")
    result = score_tasks(tasks, SETTINGS, path, lambda: asyncio.run(ask_judges(tasks, SETTINGS, judges)), 5.0)
    assert path == str(tmp_path / "data" / "grpo" / "train.difficulty.jsonl")
    out = capsys.readouterr().out
    assert "asking the judges how hard each of 5 tasks is" in out and "1/5 tasks answered" in out
    assert "5 tasks scored in" in out and "1 replies without a number, 1 failed calls" in out
    median = 7.0  # of the numbers found: 7, 1, 9.5
    assert [t.row["difficulty"] for t in tasks] == [7.0, 1.0, 9.5, median, median]
    assert (result.unparsed, result.failed) == (1, 1)  # "easy!" has no number; "9+9=" failed
    assert sorted(_Judge.calls) == sorted(REPLIES)  # one call per task
    assert result.scalars()["data/judge_difficulty_unparsed"] == 1.0

    # a resumed run (or engine 1, which never asks) reads engine 0's file: same numbers, no call
    again = _tasks()
    score_tasks(again, SETTINGS, path, None, 5.0)
    assert [t.row["difficulty"] for t in again] == [t.row["difficulty"] for t in tasks]
    assert len(_Judge.calls) == len(REPLIES)

    # the curriculum ranks by them: its first batch comes from the easiest share
    selector = build_selector(again, 0, SelectorConfig(name="curriculum", start_fraction=0.2, pace_steps=100))
    assert {t.prompt for t in selector.next_batch(4)} == {"1+2="}


def test_a_file_of_another_taskset_is_refused_and_an_engine_without_the_file_waits_then_says_why(judges, tmp_path):
    tasks, path = _tasks(), scores_path(str(tmp_path), "grpo", "train.jsonl")
    score_tasks(tasks, SETTINGS, path, lambda: asyncio.run(ask_judges(tasks, SETTINGS, judges)), 5.0)
    other = [Task(index=9, prompt="2+2=", answer="4")]
    with pytest.raises(ValueError, match="another taskset .*delete it to ask the judges again"):
        score_tasks(other, SETTINGS, path, None, 5.0)
    with pytest.raises(RuntimeError, match="did not appear within 0.2s .*engine 0 asks the judges"):
        score_tasks(other, SETTINGS, str(tmp_path / "none.jsonl"), None, 0.2)
    (tmp_path / "edited.jsonl").write_text('{"summary": {}}\n{"id": "9", "score": 1\n')
    with pytest.raises(ValueError, match="edited.jsonl is not a file of difficulty scores .*delete it"):
        score_tasks(other, SETTINGS, str(tmp_path / "edited.jsonl"), None, 5.0)


def test_a_judge_that_never_answers_a_number_is_an_error_naming_the_settings(judges):
    tasks = [t for t in _tasks() if t.prompt == "3+4="]
    with pytest.raises(ValueError, match="no number for any of 1 tasks .*'easy!'.*judge_difficulty.prompt"):
        asyncio.run(ask_judges(tasks, SETTINGS, judges))


@pytest.mark.parametrize("overrides, message", [
    (["+stages.1.data.judge_difficulty.enabled=true"], "data.judge_difficulty.enabled=True is invalid: .*cluster.judge_ranks=1"),
    (["+stages.0.data.judge_difficulty.enabled=true", "cluster.judge_ranks=1"], "explores none"),
    (["+stages.1.data.judge_difficulty={enabled: true, prompt: 'rate {question}'}", "cluster.judge_ranks=1"],
     r"judge_difficulty.prompt=.*names \{question\}; use \{prompt\} and \{answer\}"),
])
def test_the_config_names_what_is_wrong(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg("+experiment=quickstart", "run.output_dir=/tmp/unused", *overrides))
