"""Synthetic arithmetic tasksets (`a+b=`) generated with a fixed seed: the quickstart's data.

Train and eval sets are disjoint, so eval accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import json
import os

import numpy as np

from rft.config import ArithmeticTaskConfig


def _problems(cfg: ArithmeticTaskConfig, seed: int) -> list[tuple[int, int]]:
    total = cfg.num_train + cfg.num_eval
    space = (cfg.max_operand + 1) ** 2
    if total > space:
        raise ValueError(
            f"data.arithmetic: num_train+num_eval={total} exceeds the {space} distinct problems "
            f"with max_operand={cfg.max_operand}; raise data.arithmetic.max_operand"
        )
    rng = np.random.default_rng(seed)
    flat = rng.choice(space, size=total, replace=False)
    return [(int(i) // (cfg.max_operand + 1), int(i) % (cfg.max_operand + 1)) for i in flat]


def carries(a: int, b: int) -> int:
    """Carries written down when adding a and b by hand: the problem's difficulty for a curriculum
    (data.selector.name=curriculum ranks tasks by the `difficulty` column)."""
    count, carry = 0, 0
    while a or b:
        carry = (a % 10 + b % 10 + carry) // 10
        count += carry
        a, b = a // 10, b // 10
    return count


def write_arithmetic_tasksets(cfg: ArithmeticTaskConfig, train_path: str, eval_path: str, seed: int) -> None:
    """Write the train and eval problems as jsonl (keys `question`, `answer`, `difficulty`: the
    number of carries) to the given paths."""
    problems = _problems(cfg, seed)
    for path, rows in ((train_path, problems[: cfg.num_train]), (eval_path, problems[cfg.num_train:])):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            for a, b in rows:
                f.write(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b), "difficulty": carries(a, b)}) + "\n")
        os.replace(path + ".tmp", path)
