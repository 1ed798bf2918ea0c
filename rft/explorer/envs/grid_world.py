"""A small grid world the tiny quickstart model can learn to walk in: reach the goal, turn by turn.

    goal 4 1          <- first observation: the goal's x y, then where the walker is
    at 2 3
    e                 <- the model's move: n (y - 1), s (y + 1), e (x + 1), w (x - 1)
    at 3 3            <- the new position; a move into the wall or anything else stays put
    n
    at 3 2
    ...

The episode ends with reward 1 (less `step_penalty` per move beyond the shortest path) when the
walker reaches the goal; the workflow's `rollout.max_turns` ends it otherwise. With
`progress_reward` each move also earns that much for getting closer to the goal and loses it for
not (a dense signal: whole-episode rewards alone leave GRPO guessing which moves helped). Every
observation is text the character tokenizer of the tiny model covers (as transformers loads it,
that tokenizer drops spaces and newlines: the model reads "goal41at23"). The final step's
metrics say whether the walker got there.

Tasks are taskset rows {"start": [x, y], "goal": [x, y]}: `sample_tasks` draws them,
`sample_demos` writes conversations of a walker who knows the way only part of the time, for a
supervised warm-up that teaches the format (a move per turn) and some of the skill.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rft.explorer.envs.registry import ENVIRONMENTS

MOVES = {"n": (0, -1), "s": (0, 1), "e": (1, 0), "w": (-1, 0)}


@ENVIRONMENTS.register("grid_world")
class GridWorldEnv(gym.Env):
    """Walk from `start` to `goal` on a `size` x `size` grid (coordinates 0..size-1)."""

    required_columns = ("start", "goal")

    def __init__(self, size: int = 5, step_penalty: float = 0.0, progress_reward: float = 0.0):
        if size < 2 or size > 10:
            raise ValueError(f"grid_world size={size}: use 2 to 10 (one digit per coordinate)")
        self.size, self.step_penalty, self.progress_reward = size, step_penalty, progress_reward
        self.observation_space = spaces.Text(max_length=64)
        self.action_space = spaces.Text(max_length=64)
        self.position = self.goal = (0, 0)
        self.moves = 0
        self.shortest = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        row = (options or {})["task"].row
        self.position, self.goal = self._cell(row, "start"), self._cell(row, "goal")
        self.moves = 0
        self.shortest = abs(self.goal[0] - self.position[0]) + abs(self.goal[1] - self.position[1])
        return f"goal {self.goal[0]} {self.goal[1]}\n{self._at()}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        move = MOVES.get(action.strip()[:1])
        self.moves += 1
        before = self._distance()
        if move is not None:
            x, y = self.position[0] + move[0], self.position[1] + move[1]
            if 0 <= x < self.size and 0 <= y < self.size:
                self.position = (x, y)
        shaped = self.progress_reward * (1.0 if self._distance() < before else -1.0)  # bumps and detours cost
        if self.position == self.goal:
            reward = shaped + 1.0 - self.step_penalty * (self.moves - self.shortest)
            return "", reward, True, False, {"metrics": {"success": 1.0}}
        return self._at(), shaped, False, False, {"metrics": {"success": 0.0}}

    def _distance(self) -> int:
        return abs(self.goal[0] - self.position[0]) + abs(self.goal[1] - self.position[1])

    def _at(self) -> str:
        return f"at {self.position[0]} {self.position[1]}\n"

    def _cell(self, row: dict, key: str) -> tuple[int, int]:
        value = row.get(key)
        if not (isinstance(value, (list, tuple)) and len(value) == 2
                and all(isinstance(v, int) and 0 <= v < self.size for v in value)):
            raise ValueError(f"grid_world task column {key!r} must be [x, y] with 0 <= x, y < {self.size}, "
                             f"got {value!r}")
        return int(value[0]), int(value[1])

    @staticmethod
    def sample_tasks(n: int, seed: int, size: int = 5) -> list[dict]:
        """`n` distinct (start, goal) pairs with start != goal, in a seeded order."""
        cells = [(x, y) for x in range(size) for y in range(size)]
        pairs = [(s, g) for s in cells for g in cells if s != g]
        if n > len(pairs):
            raise ValueError(f"grid_world has {len(pairs)} distinct tasks on a {size}x{size} grid; asked for {n}")
        order = np.random.default_rng(seed).permutation(len(pairs))[:n]
        return [{"start": list(pairs[i][0]), "goal": list(pairs[i][1])} for i in order]

    @staticmethod
    def sample_demos(n: int, seed: int, size: int = 5, max_turns: int = 8, skill: float = 0.0) -> list[dict]:
        """`n` conversations ({"messages": [...]}) of at most `max_turns` moves by a walker that
        takes a shortest-path move with probability `skill` and otherwise a uniformly random move
        that stays on the grid: skill 0 shows the format of the game and none of its skill."""
        rng = np.random.default_rng(seed)
        env = GridWorldEnv(size)
        tasks = GridWorldEnv.sample_tasks(min(n, size * size * (size * size - 1)), seed + 1, size)
        rows = []
        for i in range(n):
            task = tasks[i % len(tasks)]  # more demos than tasks: the same task, another walk
            observation, _ = env.reset(options={"task": _Row(task)})
            messages = [{"role": "user", "content": observation}]
            for _ in range(max_turns):
                legal = [m for m, (dx, dy) in MOVES.items()
                         if 0 <= env.position[0] + dx < size and 0 <= env.position[1] + dy < size]
                closer = [m for m in legal if _distance(_moved(env.position, m), env.goal) < env._distance()]
                options = closer if rng.random() < skill else legal
                move = options[rng.integers(len(options))]
                messages.append({"role": "assistant", "content": move})
                observation, _, done, _, _ = env.step(move)
                if done:
                    break
                messages.append({"role": "user", "content": observation})
            if messages[-1]["role"] != "assistant":
                messages.pop()  # nothing to learn after the last move
            rows.append({"messages": messages, **task})
        return rows


def _moved(position: tuple[int, int], move: str) -> tuple[int, int]:
    return position[0] + MOVES[move][0], position[1] + MOVES[move][1]


def _distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


class _Row:
    """Stands in for a Task where only `row` is read (demos are drawn before any taskset exists)."""

    def __init__(self, row: dict):
        self.row = row
