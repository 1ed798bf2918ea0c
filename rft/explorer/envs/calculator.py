"""Tool use: answer an arithmetic (or any) question, running Python in a sandbox on the way.

    What is 123*45? ...             <- first observation: the question inside `instructions`
    ```python                       <- the model's tool call: a fenced Python block ...
    print(123 * 45)
    ```
    5535                            <- ... comes back as a "tool" message: what it printed
    calc 123*45                     <- or, for tiny plain-text models, one line `calc <expression>`
    = 5535                          <- ... answered in one short line
    The answer is 5535.             <- anything without a tool call is the final answer

The final answer goes to the run's reward function as `info["answer"]` (scored against the
task's reference answer); the environment itself gives reward 0. After `max_tool_calls` tool
calls the next one ends the episode (truncated), its text taken as the answer. Code runs in
`rft.explorer.envs.sandbox` (time and memory limits, no network, writes only in a temp dir).

Tasks are rows with a prompt column and an answer column (`data.prompt_key`/`data.answer_key`);
`sample_tasks` writes arithmetic ones ({"question": "What is 123*45?", "answer": "5535"}).
"""

from __future__ import annotations

import ast
import random
import re
import string
from typing import Any

import gymnasium as gym

from rft.explorer.envs.registry import ENVIRONMENTS
from rft.explorer.envs.sandbox import run_python

DEFAULT_INSTRUCTIONS = (
    "{question}\n\n"
    "You may run Python to help: write a ```python code block and you will get back what it prints "
    "(or the value of its last line). When you know the answer, reply without a code block and end "
    "with the final answer."
)

_PYTHON_BLOCK = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)```", re.DOTALL)
_CALC_LINE = re.compile(r"^[ \t]*calc[ \t]+(.+?)[ \t]*$", re.MULTILINE)
# `calc` sees math's names; math.pow would shadow the exact integer builtin pow
_CALC_PRELUDE = "from math import *\nfrom builtins import pow\n"


@ENVIRONMENTS.register("calculator")
class CalculatorEnv(gym.Env):
    """The task's question; tool calls run in the sandbox until a reply without one answers it."""

    required_columns = ("prompt", "answer")  # roles: the configured prompt and answer columns

    def __init__(self, instructions: str = DEFAULT_INSTRUCTIONS, max_tool_calls: int = 4,
                 timeout_s: float = 5.0, memory_mb: int = 512) -> None:
        _check_instructions(instructions)
        if not (isinstance(max_tool_calls, int) and max_tool_calls >= 0):
            raise ValueError(f"calculator max_tool_calls={max_tool_calls!r}: use an int >= 0 "
                             "(0: every tool call ends the episode)")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 600):
            raise ValueError(f"calculator timeout_s={timeout_s!r}: use seconds in (0, 600]")
        if not (isinstance(memory_mb, int) and memory_mb >= 64):
            raise ValueError(f"calculator memory_mb={memory_mb!r}: use an int >= 64")
        self.instructions, self.max_tool_calls = instructions, max_tool_calls
        self.timeout_s, self.memory_mb = float(timeout_s), memory_mb
        self.tool_calls = self.tool_errors = 0
        self.done = True  # until reset

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        task = (options or {}).get("task")
        question = getattr(task, "prompt", None)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"calculator: reset needs options={{'task': Task}} with a prompt (the "
                             f"data.prompt_key column), got task={task!r:.80}")
        self.tool_calls = self.tool_errors = 0
        self.done = False
        return self.instructions.format(question=question), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("calculator: step() after the episode ended; call reset() first")
        block = _PYTHON_BLOCK.search(action)
        calc = None if block else _CALC_LINE.search(action)
        if block is None and calc is None:
            self.done = True
            return "", 0.0, True, False, {"answer": action.strip(), "metrics": self._metrics()}
        if self.tool_calls >= self.max_tool_calls:
            self.done = True
            return (f"tool-call limit reached ({self.max_tool_calls})", 0.0, False, True,
                    {"answer": action.strip(), "metrics": self._metrics()})
        self.tool_calls += 1
        observation, failed = self._python(block.group(1)) if block else self._calc(calc.group(1))
        self.tool_errors += failed
        return observation, 0.0, False, False, {"role": "tool", "tool_calls": 1}

    def _python(self, code: str) -> tuple[str, bool]:
        result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            show_last_expression=True)
        return result.summary() + "\n", bool(result.error)

    def _calc(self, expression: str) -> tuple[str, bool]:
        try:  # a statement would run too, but `calc` promises an expression: say so, cheaply
            ast.parse(expression, mode="eval")
        except SyntaxError as err:
            return f"error: SyntaxError: {err.msg}\n", True
        result = run_python(_CALC_PRELUDE + expression, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            max_output_chars=200, show_last_expression=True)
        if result.error:
            return f"error: {result.error.split(' (line ')[0]}\n", True
        return f"= {result.stdout.strip()}\n", False

    def _metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.tool_calls), "tool_errors": float(self.tool_errors)}

    @staticmethod
    def sample_tasks(n: int, seed: int, digits: int = 3) -> list[dict]:
        """`n` distinct arithmetic questions in a seeded order: products of a `digits`-digit number
        and a 2-to-`digits`-digit one, and sums of two (`digits` + 1)-digit numbers."""
        if not (isinstance(digits, int) and 2 <= digits <= 9):
            raise ValueError(f"calculator sample_tasks digits={digits!r}: use 2 to 9")
        if n < 0:
            raise ValueError(f"calculator sample_tasks n={n}: must be >= 0")
        high = 10 ** digits
        if n > (high - high // 10) ** 2 // 4:  # far below the number of distinct questions
            raise ValueError(f"calculator sample_tasks: n={n} is too many for digits={digits}; raise digits")
        rng = random.Random(seed)
        rows: dict[str, str] = {}
        while len(rows) < n:
            if rng.random() < 0.5:
                a, b = rng.randrange(high // 10, high), rng.randrange(10, high)
                rows.setdefault(f"What is {a}*{b}?", str(a * b))
            else:
                a, b = rng.randrange(high, 10 * high), rng.randrange(high, 10 * high)
                rows.setdefault(f"What is {a}+{b}?", str(a + b))
        return [{"question": q, "answer": a} for q, a in rows.items()]


def _check_instructions(instructions: str) -> None:
    """`instructions` must be a format string using `{question}` and nothing else."""
    if not isinstance(instructions, str):
        raise ValueError(f"calculator instructions={instructions!r}: must be a string with '{{question}}'")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(instructions) if name is not None}
    except ValueError as err:
        raise ValueError(f"calculator instructions={instructions!r:.60} is not a valid format string ({err}); "
                         "write literal braces as '{{' and '}}'") from None
    if names != {"question"}:
        raise ValueError(f"calculator instructions={instructions!r:.60} must use '{{question}}' and no other "
                         f"field (found {sorted(names) or 'none'}); write literal braces as '{{' and '}}'")
