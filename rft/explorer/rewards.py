"""Reward functions, their registry, and a scorer that isolates them.

Registry REWARDS; a reward sees the whole trajectory (an experience record: its `response` text,
`token_ids`, `turns`, `tool_calls`, `metrics`, ...) and the task (`task.answer`, `task.prompt`,
`task.row` with every column of the taskset row):

    fn(trajectory: Experience, task: Task) -> float                  one at a time
    fn(trajectories: list[Experience], tasks: list[Task]) -> list    batch form
    fn(group: list[Experience], task: Task) -> list                   group form: all samples of one task
    async def fn(trajectory, task) -> float                           async form (e.g. asking a judge engine)
    fn(data_source, solution_str, ground_truth, extra_info)           verl's compute_score, adapted
                                                                      (rft/explorer/reward_adapters.py)

A reward (one value of a batch) is a number, or a dict with "score" and other values, as verl's
compute_score may return: "score" is the reward, the other numeric values become the
trajectory's metrics (logged as rollout/<key>, the means of a step).

A group reward scores a task's samples relative to each other (relative_judge): the runner calls it
once per task, after every sample of the task came back (a sample that failed every try is left
out; a trajectory of several experiences, step_wise, is one member: its last one, whose score its
steps share). Any form may be `async def`; the form is told by the parameter names.

`algorithm.reward` takes a built-in name (`exact_match`, `math_verify`, `llm_judge`, `relative_judge`,
`reward_model`) or your own function, as a file `path/to/rewards.py:fn` or a dotted path
`my_pkg.rewards.fn` (rft/registry.py); its signature is checked at launch.
Workflows whose environment gives the reward (grid_world) leave this unused.

`RewardScorer` runs a reward with a time limit per sample (`rollout.reward_timeout_s`; a batch
call gets that per sample): a sample whose reward raises or runs too long scores 0.0, is counted,
and scoring goes on.

Why the scorer uses a child process and not a thread: a thread cannot be stopped, and worse, a
reward stuck inside C code that holds the GIL freezes the whole interpreter, so the caller's
timeout never fires. math_verify does exactly that: `verify` on a response like
`\\boxed{9^{9^{9^{9}}}}` makes sympy evaluate a power tower in C for ever. A forked child can be
killed. It is forked (not spawned) so that any callable works, including rewards registered inside
tests or scripts, and so that a restart after a timeout costs milliseconds, not a fresh import of
sympy. The child only runs the reward: it never touches CUDA, vLLM or sockets it inherited, and
if a lock inherited from another thread ever deadlocks it, that shows up as a timeout, the child is
killed and a fresh one is forked. Nor does it hold the parent's files: every descriptor it
inherited is pointed at /dev/null (a pipe of a subprocess another thread was starting would
otherwise stay open while the child lives). Linux only (fork). Async rewards run on the caller's event loop
instead (they wait on I/O; `asyncio.wait_for` bounds them), so they must not block it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import multiprocessing
import numbers
import os
from collections.abc import Mapping
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable


from rft.explorer.math_answers import math_verify_answer
from rft.explorer.reward_adapters import VERL_PARAMS, from_verl
from rft.registry import Registry

if TYPE_CHECKING:
    from rft.buffer.experience import Experience
    from rft.data.taskset import Task

REWARDS = Registry("reward", params=("trajectory", "task"), returns="float",
                   variants={"batch": ("trajectories", "tasks"), "group": ("group", "task"), "verl": VERL_PARAMS},
                   adapters={"verl": from_verl})

logger = logging.getLogger(__name__)


def first_line_matches(response: str, answer: str) -> float:
    """1.0 if the response's first line, whitespace-trimmed, is exactly the answer."""
    lines = response.strip().splitlines()
    first = lines[0].strip() if lines else ""
    return 1.0 if first and first == answer.strip() else 0.0


@REWARDS.register("exact_match", needs_answer=True)
def exact_match(trajectory: Experience, task: Task) -> float:
    """1.0 if the response's first line, whitespace-trimmed, is exactly the task's answer.

    For synthetic arithmetic: the policy answers `68` and may ramble on after a newline, which is
    ignored; `68.0`, `068` or `The answer is 68` are wrong on purpose (the format is part of the task).
    """
    return first_line_matches(trajectory.response, _answer(task, "exact_match"))


def _answer(task: Task, reward: str) -> str:
    if task.answer is None:
        raise ValueError(f"reward {reward} compares with the task's answer, but task {task.task_id} has none "
                         "(data.answer_key names the column)")
    return task.answer


@REWARDS.register("math_verify", needs_answer=True, preload=("math_verify",))
def math_verify(trajectory: Experience, task: Task) -> float:
    """1.0 if math-verify finds the response's final answer equal to the task's answer: GSM8K's
    `#### 72`, a `\\boxed{}` solution or a plain answer (rft/explorer/math_answers.py)."""
    return math_verify_answer(trajectory.response, _answer(task, "math_verify"))


# short: it must fit small judges' contexts (the quickstart's tiny model has 64 tokens)
JUDGE_PROMPT = "{question}\nReference: {answer}\nResponse: {response}\nCorrect (yes/no)?"


@REWARDS.register("llm_judge", needs_answer=True, judge_kind="generate")
async def llm_judge(trajectory: Experience, task: Task) -> float:
    """1.0 if the judge engine (cluster.judge_ranks, rft/explorer/judge.py) answers "yes" to
    JUDGE_PROMPT with the task's question, reference answer and the response. A plain completion,
    so any judge model works; write your own async reward with `judge.chat` for an instruct
    judge and a rubric of your own."""
    from rft.explorer.judge import judge

    verdict = await judge.complete(JUDGE_PROMPT.format(question=task.prompt or "", answer=_answer(task, "llm_judge"),
                                                       response=trajectory.response.strip()), max_new_tokens=4)
    return 1.0 if verdict.strip().lower().startswith("yes") else 0.0


@REWARDS.register("reward_model", judge_kind="classify")
async def reward_model(trajectory: Experience, task: Task) -> float:
    """The reward model's score (judge.kind=classify on cluster.judge_ranks: an HF
    sequence-classification model, rft/explorer/judge.py) of the prompt followed by the response."""
    from rft.explorer.judge import judge

    return (await judge.score([(task.prompt or "") + trajectory.response]))[0]


@REWARDS.register("relative_judge", judge_kind="generate")
async def relative_judge(group: list[Experience], task: Task) -> list[float]:
    """RULER-style relative judging: the group's answers to the task go to the judge engine in one
    prompt with a rubric (judge.rubric), one score in [0, 1] per answer comes back; a reply that
    does not parse, a timeout or an error score the group's mean, counted (rft/explorer/relative_judge.py)."""
    from rft.explorer.judge import judge
    from rft.explorer.relative_judge import judge_group

    return await judge_group(group, task, judge)


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; they are off on purpose, see above.

    Without this filter every freshly forked reward process repeats that warning.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


_FLOAT32_MAX = 3.4028234663852886e38  # rewards are stored as float32 (rft/buffer/experience.py)


def _reward_value(value: Any) -> float:
    """One reward as a float. A number (Python's, NumPy's, a one-element tensor's `.item()`; a bool
    counts as 0 or 1), finite and within float32's range, which the buffer stores: `float()` alone
    took the string "0.5" and turned 1e39 into inf in the shard."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(f"reward returned {value!r:.40} ({type(value).__name__}), which is not a number")
    value = float(value)
    if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
        raise ValueError(f"reward returned {value}, which is not a finite float32 number")
    return value


Scored = tuple[float, dict[str, float]]  # a sample's reward, and the metrics a dict result carried


def _scored(value: Any) -> Scored:
    """One reward: a number, or a dict with "score" and other values (verl's compute_score form),
    whose other finite numbers are kept as metrics; the rest (verl's "pred" text) is left out."""
    if not isinstance(value, Mapping):
        return _reward_value(value), {}
    if "score" not in value:
        raise ValueError(f"reward returned a dict without a 'score' key (keys: {', '.join(map(str, value))}); "
                         "return a number, or a dict with 'score' and other values")
    metrics = {}
    for key, item in value.items():
        if key != "score":
            try:
                metrics[str(key)] = _reward_value(item)
            except (ValueError, RuntimeError):  # not one finite number (`.item()` of a longer array)
                pass
    return _reward_value(value["score"]), metrics


def _per_sample(result: Any, batch: bool, n: int) -> list[Any]:
    if not batch:
        return [result]
    if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__"):
        raise ValueError(f"batch reward returned {result!r:.40} ({type(result).__name__}), not a list of rewards")
    if len(result) != n:
        raise ValueError(f"batch reward returned {len(result)} rewards for {n} trajectories")
    return list(result)


def reward_results(result: Any, batch: bool, n: int) -> list[Scored]:
    """What a reward function returned, checked: one reward, or (batch) a sequence of n; each a
    number or a dict with "score"."""
    return [_scored(v) for v in _per_sample(result, batch, n)]


def reward_values(result: Any, batch: bool, n: int) -> list[float]:
    """`reward_results` for numbers only: one number, or (batch) a sequence of n numbers."""
    return [_reward_value(v) for v in _per_sample(result, batch, n)]


def _serve(fn: Callable, conn: Connection, parent_end: Connection) -> None:
    """Child process loop: call `fn(*args)` for each request until the parent closes the pipe.
    A request is (args, batch): a batch call returns one reward per sample."""
    # Our copy of the parent's end would keep the pipe open and hide the parent's exit from us.
    parent_end.close()
    _let_go_of_inherited_files(keep={0, 1, 2, conn.fileno()})
    # Ctrl-C reaches the whole process group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            args, batch = conn.recv()
        except EOFError:
            return
        try:
            result = fn(*args)
            reply: tuple = ("ok", reward_results(result, batch, len(args[0]) if batch else 1))
        except Exception as exc:  # the reward's own bug or bad input: report it, keep serving
            reply = ("error", type(exc).__name__, str(exc))
        conn.send(reply)


def _let_go_of_inherited_files(keep: set[int]) -> None:
    """Point every file descriptor the fork copied from the parent, but `keep`, at /dev/null.

    The parent's other threads may be starting a subprocess at the moment of the fork (the
    calculator's sandbox): our copy of its pipes would hold them open for as long as this process
    lives, and subprocess.Popen reads its exec-status pipe until every writer is gone, so the tool
    call hung for good (gsm8k_tool on CPU). dup2 over them rather than close: a Python object
    inherited from the parent may still close its number one day, and must not close a file the
    reward has opened since under that number."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != devnull:
            try:
                os.dup2(devnull, fd)
            except OSError:  # the descriptor that listed the directory, closed since
                pass
    os.close(devnull)


class _Child:
    """A forked process that runs one reward function, one request at a time."""

    def __init__(self, fn: Callable, name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child_end = ctx.Pipe()
        # daemon: multiprocessing kills it when the parent exits normally; on a hard parent
        # death the child sees EOF on the pipe and returns.
        self.proc = ctx.Process(target=_serve, args=(fn, child_end, self.conn),
                                name=f"rft-reward-{name}", daemon=True)
        self.proc.start()
        child_end.close()

    def call(self, args: tuple, batch: bool, timeout_s: float) -> tuple | None:
        """The child's reply, or None if it did not answer within `timeout_s`."""
        try:
            self.conn.send((args, batch))
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv()
        except (EOFError, OSError):  # the process died (segfault, os._exit, OOM kill)
            self._wait(5)
            return ("error", "RewardProcessDied",
                    f"reward process exited with code {self.proc.exitcode}")

    def kill(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self._wait(5)

    def close(self) -> None:
        """Ask the child to exit (EOF), and kill it if it does not."""
        self.conn.close()
        self._wait(1)
        if self.proc.is_alive():
            self.proc.kill()
            self._wait(5)

    def _wait(self, timeout_s: float) -> None:
        """Until the process has ended (and is reaped) or `timeout_s` have passed. Not
        Process.join(timeout): that waits on the exit sentinel, a pipe the child let go of with
        its other inherited files, and then blocks in waitpid for as long as the child lives."""
        deadline = time.monotonic() + timeout_s
        while self.proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)


def _settle(trajectories: list[Experience], results: list[Scored]) -> list[float]:
    """The rewards of `results`; the metrics a dict result carried go into its trajectory's."""
    for trajectory, (_, metrics) in zip(trajectories, results):
        trajectory.metrics.update(metrics)
    return [value for value, _ in results]


class RewardScorer:
    """Scores trajectories with a reward (a REWARDS name, a dotted path or a function); a raising
    or slow sample scores 0.0 and is counted.

    `errors` and `timeouts` count such samples over the scorer's life. Each kind of failure
    (a timeout, an exception type) is logged once with its first message, so a reward that fails
    on every sample does not flood the log. Plain rewards run in a forked child process (see the
    module docstring): on a timeout the child is killed, so a reward that never returns, even one
    stuck in C code, cannot hang `score`; the next call gets a freshly forked child. A batch
    reward that fails scores its whole batch 0.0 (a group reward: its group). Safe to call from any thread; calls are
    serialised. Call `close()` (or use `with`) when done.
    """

    def __init__(self, spec: str | Callable, timeout_s: float) -> None:
        self.fn = REWARDS.resolve(spec)
        for module in REWARDS.meta(self.fn).get("preload", ()):
            importlib.import_module(module)  # once, here: every forked child then has it
        if not timeout_s > 0:
            raise ValueError(
                f"rollout.reward_timeout_s={timeout_s!r} is invalid: use a positive number of "
                f"seconds, e.g. 10"
            )
        self.name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
        # a group reward is called as a batch is, one reward per sample back, with the group's one task
        self.group = REWARDS.variant(self.fn) == "group"
        self.batch = self.group or REWARDS.variant(self.fn) == "batch"
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.timeout_s = float(timeout_s)
        self.errors = 0
        self.timeouts = 0
        self._logged: set[str] = set()
        self._child: _Child | None = None
        self._lock = threading.Lock()

    def score(self, trajectories: list[Experience], tasks: list[Task]) -> list[float]:
        """One reward per (trajectory, task) pair, in order (a group reward: one task's samples).
        A reward's dict result's other numbers go into its trajectory's `metrics`."""
        self._check(trajectories, tasks)
        if self.is_async:
            return asyncio.run(self.score_async(trajectories, tasks))
        with self._lock:
            if self.batch:
                results = self._call(self._batch_args(trajectories, tasks), len(trajectories)) if trajectories else []
            else:
                results = [self._call((t, task), 1)[0] for t, task in zip(trajectories, tasks)]
        return _settle(trajectories, results)

    async def score_async(self, trajectories: list[Experience], tasks: list[Task]) -> list[float]:
        """`score` for callers on an event loop: plain rewards run in a worker thread (and their
        child process), async ones on this loop, all samples at once."""
        self._check(trajectories, tasks)
        if not self.is_async:
            return await asyncio.to_thread(self.score, trajectories, tasks)
        if self.batch:
            if not trajectories:
                return []
            results = await self._await(self.fn(*self._batch_args(trajectories, tasks)), len(trajectories))
        else:
            results = [r for rs in await asyncio.gather(*(self._await(self.fn(t, task), 1)
                                                          for t, task in zip(trajectories, tasks))) for r in rs]
        return _settle(trajectories, results)

    def _check(self, trajectories: list, tasks: list) -> None:
        if len(trajectories) != len(tasks):
            raise ValueError(
                f"score() got {len(trajectories)} trajectories but {len(tasks)} tasks; pass one "
                f"task per trajectory (repeat a task for each sample of its group)"
            )
        if self.group and len({task.task_id for task in tasks}) > 1:
            raise ValueError(f"reward {self.name!r} scores one group at a time (its form is fn(group, task)), but "
                             f"score() got the samples of {len({t.task_id for t in tasks})} tasks; call it per task")

    def _batch_args(self, trajectories: list[Experience], tasks: list[Task]) -> tuple:
        return (list(trajectories), tasks[0]) if self.group else (list(trajectories), list(tasks))

    async def _await(self, pending: Any, n: int) -> list[Scored]:
        try:
            result = await asyncio.wait_for(pending, self.timeout_s * n)
            return reward_results(result, self.batch, n)
        except asyncio.TimeoutError:
            return self._timed_out(n)
        except Exception as exc:
            return self._failed(type(exc).__name__, str(exc), n)

    def _call(self, args: tuple, n: int) -> list[Scored]:
        if self._child is None:
            self._child = _Child(self.fn, self.name)
        reply = self._child.call(args, self.batch, self.timeout_s * n)
        if reply is None:
            self._child.kill()
            self._child = None
            return self._timed_out(n)
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "RewardProcessDied":
            self._child = None
        return self._failed(kind, message, n)

    def _timed_out(self, n: int) -> list[Scored]:
        self.timeouts += n
        self._warn_once("timeout", f"reward {self.name!r} took longer than {self.timeout_s:g} s "
                                   f"(rollout.reward_timeout_s) on a sample; it scores 0.0")
        return [(0.0, {})] * n

    def _failed(self, kind: str, message: str, n: int) -> list[Scored]:
        self.errors += n
        self._warn_once(kind, f"reward {self.name!r} raised {kind}: {message}; the sample scores 0.0")
        return [(0.0, {})] * n

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("%s (further %s failures are counted, not logged)", message, kind)

    def close(self) -> None:
        """Stop the child process; a later `score` starts a new one."""
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
