"""Reward functions `reward(response, answer) -> float`, a registry of them, and a safe scorer.

`algorithm.reward` names an entry of `REWARDS`. A new reward is one decorated function:

    @register_reward("my_reward")
    def my_reward(response: str, answer: str) -> float: ...

`RewardScorer` runs a reward over a batch with a per-sample time limit (`rollout.reward_timeout_s`):
a sample whose reward raises or runs too long scores 0.0, is counted, and scoring goes on.

Why the scorer uses a child process and not a thread: a thread cannot be stopped, and worse, a
reward stuck inside C code that holds the GIL freezes the whole interpreter, so the caller's
timeout never fires. math_verify does exactly that: `verify` on a response like
`\\boxed{9^{9^{9^{9}}}}` makes sympy evaluate a power tower in C for ever. A forked child can be
killed. It is forked (not spawned) so that any callable works, including rewards registered inside
tests or scripts, and so that a restart after a timeout costs milliseconds, not a fresh import of
sympy. The child only runs the reward: it never touches CUDA, vLLM or sockets it inherited, and
if a lock inherited from another thread ever deadlocks it, that shows up as a timeout, the child is
killed and a fresh one is forked. Linux only (fork).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection
from typing import Callable

from math_verify import parse, verify

RewardFn = Callable[[str, str], float]

REWARDS: dict[str, RewardFn] = {}

logger = logging.getLogger(__name__)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` selectable as `algorithm.reward=<name>`."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = REWARDS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"reward {name!r} is already registered ({existing.__module__}."
                f"{existing.__qualname__}); pick another name for {fn.__module__}.{fn.__qualname__}"
            )
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward registered as `name`; ValueError listing the registered names otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"algorithm.reward={name!r} is not a registered reward; choose one of "
            f"{sorted(REWARDS)} or register a new one with @register_reward({name!r}) "
            f"(see rft/explorer/rewards.py)"
        ) from None


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1.0 if the response's first line, whitespace-trimmed, is exactly the answer.

    For synthetic arithmetic: the policy answers `68` and may ramble on after a newline, which is
    ignored; `68.0`, `068` or `The answer is 68` are wrong on purpose (the format is part of the task).
    """
    lines = response.strip().splitlines()
    first = lines[0].strip() if lines else ""
    return 1.0 if first and first == answer.strip() else 0.0


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last `####`, commas removed.

    An answer without `####` is taken to be the final answer already (e.g. a bare "72").
    """
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


@register_reward("math_verify")
def math_verify_reward(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to the GSM8K gold answer.

    math-verify's `parse` extracts `\\boxed{72}`, "The answer is 72", a bare "72" (it takes the
    last number it finds otherwise). A response in GSM8K's own format is read after its last
    `####` first, so a trailing remark like "#### 72\\nHope this helps, 5 stars" is not read as 5.

    Timeouts are off here (`parsing_timeout=None`, `timeout_seconds=None`): math-verify implements
    them with SIGALRM, which raises ValueError outside the main thread and would clobber the
    caller's own alarm handler. `RewardScorer` enforces the time limit instead.
    """
    gold = parse(gsm8k_gold(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(
            f"math_verify cannot parse the gold answer {answer!r}; check that data.answer_key "
            f"names a column holding GSM8K-style answers ('...#### 72') or bare numbers"
        )
    pred = []
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip().splitlines()
        if tail:
            pred = parse(tail[0].replace(",", ""), parsing_timeout=None)
    if not pred:
        pred = parse(response, parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns that its own timeouts are off; they are off on purpose, see above.

    Without this filter every freshly forked reward process repeats that warning.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


def _serve(fn: RewardFn, conn: Connection, parent_end: Connection) -> None:
    """Child process loop: score (response, answer) pairs until the parent closes the pipe."""
    # Our copy of the parent's end would keep the pipe open and hide the parent's exit from us.
    parent_end.close()
    # Ctrl-C reaches the whole process group; the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            response, answer = conn.recv()
        except EOFError:
            return
        try:
            value = float(fn(response, answer))
            if not math.isfinite(value):
                raise ValueError(f"reward returned {value}, which is not a finite number")
            reply: tuple = ("ok", value)
        except Exception as exc:  # the reward's own bug or bad input: report it, keep serving
            reply = ("error", type(exc).__name__, str(exc))
        conn.send(reply)


class _Child:
    """A forked process that runs one reward function, one sample per request."""

    def __init__(self, fn: RewardFn, name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child_end = ctx.Pipe()
        # daemon: multiprocessing kills it when the parent exits normally; on a hard parent
        # death the child sees EOF on the pipe and returns.
        self.proc = ctx.Process(target=_serve, args=(fn, child_end, self.conn),
                                name=f"rft-reward-{name}", daemon=True)
        self.proc.start()
        child_end.close()

    def call(self, response: str, answer: str, timeout_s: float) -> tuple | None:
        """The child's reply, or None if it did not answer within `timeout_s`."""
        try:
            self.conn.send((response, answer))
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv()
        except (EOFError, OSError):  # the process died (segfault, os._exit, OOM kill)
            self.proc.join(timeout=5)
            return ("error", "RewardProcessDied",
                    f"reward process exited with code {self.proc.exitcode}")

    def kill(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)

    def close(self) -> None:
        """Ask the child to exit (EOF), and kill it if it does not."""
        self.conn.close()
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


class RewardScorer:
    """Scores batches with the reward `name`; a raising or slow sample scores 0.0 and is counted.

    `errors` and `timeouts` count such samples over the scorer's life. Each kind of failure
    (a timeout, an exception type) is logged once with its first message, so a reward that fails
    on every sample does not flood the log. The reward runs in a forked child process (see the
    module docstring): on a timeout the child is killed, so a reward that never returns, even one
    stuck in C code, cannot hang `score`; the next sample gets a freshly forked child.
    Safe to call from any thread; calls are serialised. Call `close()` (or use `with`) when done.
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.fn = get_reward(name)
        if not timeout_s > 0:
            raise ValueError(
                f"rollout.reward_timeout_s={timeout_s!r} is invalid: use a positive number of "
                f"seconds, e.g. 10"
            )
        self.name = name
        self.timeout_s = float(timeout_s)
        self.errors = 0
        self.timeouts = 0
        self._logged: set[str] = set()
        self._child: _Child | None = None
        self._lock = threading.Lock()

    def score(self, responses: list[str], answers: list[str]) -> list[float]:
        """One reward per (response, answer) pair, in order."""
        if len(responses) != len(answers):
            raise ValueError(
                f"score() got {len(responses)} responses but {len(answers)} answers; pass one "
                f"answer per response (repeat a task's answer for each sample of its group)"
            )
        with self._lock:
            return [self._score_one(r, a) for r, a in zip(responses, answers)]

    def _score_one(self, response: str, answer: str) -> float:
        if self._child is None:
            self._child = _Child(self.fn, self.name)
        reply = self._child.call(response, answer, self.timeout_s)
        if reply is None:
            self._child.kill()
            self._child = None
            self.timeouts += 1
            self._warn_once("timeout", f"reward {self.name!r} took longer than "
                                       f"{self.timeout_s:g} s (rollout.reward_timeout_s) on a "
                                       f"sample; it scores 0.0")
            return 0.0
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        if kind == "RewardProcessDied":
            self._child = None
        self.errors += 1
        self._warn_once(kind, f"reward {self.name!r} raised {kind}: {message}; the sample "
                              f"scores 0.0")
        return 0.0

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
