"""The calculator environment: tool calls run in the sandbox and come back as tool messages, a
reply without one is the answer, the tool-call limit truncates, tasks are sampled reproducibly."""

from __future__ import annotations

import asyncio

import pytest

from rft.data.taskset import Task
from rft.explorer import envs
from rft.explorer.envs import ENVIRONMENTS, make_env, required_columns
from rft.explorer.envs.calculator import DEFAULT_INSTRUCTIONS, CalculatorEnv

TOOL = {"role": "tool", "tool_calls": 1}


def task(question: str = "What is 123*45?", answer: str = "5535") -> Task:
    return Task(0, question, answer, row={"question": question, "answer": answer})


def started(**kwargs) -> CalculatorEnv:
    env = CalculatorEnv(**kwargs)
    env.reset(seed=0, options={"task": task()})
    return env


def test_reset_returns_the_question() -> None:
    observation, info = CalculatorEnv().reset(options={"task": task()})
    assert observation == DEFAULT_INSTRUCTIONS.format(question="What is 123*45?") and info == {}
    assert "```python" in observation and observation.startswith("What is 123*45?")
    plain, _ = CalculatorEnv(instructions="Q: {question}\nA:").reset(options={"task": task()})
    assert plain == "Q: What is 123*45?\nA:"


def test_python_block_runs_in_the_sandbox() -> None:
    env = started()
    reply = "Let me compute.\n```python\nprint(123 * 45)\n```\n"
    assert env.step(reply) == ("5535\n", 0.0, False, False, TOOL)
    assert env.step("```python\nx = 123\nx * 45\n```")[0] == "5535\n"  # the last expression's value
    observation, _, done, _, info = env.step("```python\nprint(1/0)\n```")
    assert observation == "error: ZeroDivisionError: division by zero (line 1)\n" and not done
    assert info == TOOL


def test_calc_line_runs_in_the_sandbox() -> None:
    env = started()
    assert env.step("calc 123*45") == ("= 5535\n", 0.0, False, False, TOOL)
    assert env.step("calc isqrt(16) + pow(2, 70)")[0] == "= 1180591620717411303428\n"  # exact pow
    assert env.step("calc 1/0")[0] == "error: ZeroDivisionError: division by zero\n"
    assert env.step("calc 2 +")[0].startswith("error: SyntaxError")


def test_plain_reply_is_the_answer() -> None:
    env = started()
    env.step("calc 123*45")
    observation, reward, terminated, truncated, info = env.step("The answer is 5535.")
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info == {"answer": "The answer is 5535.", "metrics": {"tool_calls": 1.0, "tool_errors": 0.0}}
    with pytest.raises(RuntimeError, match="reset"):
        env.step("again")


def test_tool_call_limit_truncates() -> None:
    env = started(max_tool_calls=1)
    assert env.step("calc 1+1")[0] == "= 2\n"
    observation, _, terminated, truncated, info = env.step("calc 2+2")
    assert truncated and not terminated and "limit" in observation
    assert info["answer"] == "calc 2+2" and info["metrics"]["tool_calls"] == 1.0


def test_the_workflow_helpers_drive_it() -> None:
    env = make_env("calculator", {"max_tool_calls": 2, "instructions": "{question}"})

    async def play() -> list:
        first = await envs.reset(env, task(), seed=0)
        return [first, await envs.step(env, "calc 123*45"), await envs.step(env, "5535")]

    (observation, _), tool, final = asyncio.run(play())
    assert observation == envs.Observation("What is 123*45?") and tool[0].text == "= 5535\n"
    assert final[4]["answer"] == "5535"


def test_sample_tasks_are_deterministic_unique_and_right() -> None:
    rows = CalculatorEnv.sample_tasks(300, seed=3)
    assert rows == CalculatorEnv.sample_tasks(300, seed=3) != CalculatorEnv.sample_tasks(300, seed=4)
    assert len({row["question"] for row in rows}) == 300
    assert {"*", "+"} <= {op for row in rows for op in "*+" if op in row["question"]}
    for row in rows:
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expression)) == row["answer"]  # noqa: S307 (our own digits and an operator)
    assert CalculatorEnv.sample_tasks(5, seed=3) == rows[:5]  # a longer list extends a shorter one


def test_registered_with_its_columns() -> None:
    assert ENVIRONMENTS.resolve("calculator") is CalculatorEnv
    assert required_columns("calculator") == ("prompt", "answer")


def test_bad_arguments_name_the_key() -> None:
    with pytest.raises(ValueError, match="instructions"):
        CalculatorEnv(instructions="no placeholder")
    with pytest.raises(ValueError, match="answer"):
        CalculatorEnv(instructions="{question} {answer}")
    with pytest.raises(ValueError, match="max_tool_calls"):
        CalculatorEnv(max_tool_calls=-1)
    with pytest.raises(ValueError, match="prompt"):
        CalculatorEnv().reset(options={"task": Task(0, None, "1")})
    with pytest.raises(ValueError, match="rollout.env_args"):
        make_env("calculator", {"max_calls": 2})
