"""Environments a multi-turn workflow plays against, in Gymnasium's shape.

An environment is a `gymnasium.Env` whose observations and actions are text:

    reset(seed=None, options={"task": task}) -> (observation, info: dict)
    step(action: str) -> (observation, reward: float, terminated: bool, truncated: bool, info: dict)

An observation is text, or for a vision-language model text with images:
{"text": "...", "images": [image, ...]} ("image": one image also works), each image a PIL image, an
H x W x 3 uint8 array or encoded bytes (PNG, JPEG). `<image>` in the text marks where each image
goes; without marks they come before the text. Images add up over an episode: one trajectory holds
at most rollout.images_per_prompt of them.

`options["task"]` is the rft Task (its `row` holds every column of the taskset row). So an existing
Gymnasium text environment is used as it is (`rollout.env=my_pkg.envs.MyEnv`), and a new one is a
small class. `rollout.env` takes a built-in name or a dotted path to the class; `rollout.env_args`
are its constructor's keyword arguments. Every trajectory gets its own instance (`close()` is
called when it ends).

Conventions rft reads from `info` (all optional):
    role        the role of the next observation's message ("user" by default, "tool" for tool output)
    tool_calls  how many tool calls this step made (summed into the experience's `tool_calls`)
    answer      on the last step: the text the run's reward function (algorithm.reward) scores;
                without it the trajectory's reward is the sum of the step rewards
    metrics     on the last step: numbers to log per trajectory (e.g. {"success": 1.0})

Class attributes rft reads (optional):
    required_columns   taskset columns every row must have (rows without them are skipped, counted)
    sample_tasks(n, seed) -> list[dict]   a staticmethod that writes a taskset (`data.from_env`)

Sync environments run in a worker thread (`asyncio.to_thread`) so one slow step does not stop the
other trajectories; an environment may also define `async def reset/step`.

Built-ins: `grid_world` (rft/explorer/envs/grid_world.py), `calculator` (tool use in a sandboxed
Python subprocess, rft/explorer/envs/calculator.py).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

from rft.explorer.envs.registry import ENVIRONMENTS


@dataclass(frozen=True)
class Observation:
    """What the model is shown: `text` with one image placeholder per image (rft/data/images.py)
    when there are `images` (encoded)."""

    text: str
    images: tuple[bytes, ...] = ()

    def message(self, role: str) -> dict[str, str]:
        return {"role": role, "content": self.text}


_KEYS = {"text", "image", "images"}  # an observation's, as a dict


def observation(env: Any, value: Any) -> Observation:
    """An environment's observation as text and encoded images; ValueError naming the environment
    and what is wrong."""
    if isinstance(value, dict) and not set(value) & _KEYS:
        return Observation(str(value))  # some other dict: text, as before images
    if not isinstance(value, dict):
        if isinstance(value, str) or not _is_image(value):
            return Observation(str(value))
        value = {"images": [value]}
    unknown = set(value) - _KEYS
    if unknown or ("image" in value and "images" in value):
        raise ValueError(f"{type(env).__name__} returned an observation with keys {sorted(value)}; an "
                         "observation with images is {'text': str, 'images': [image, ...]} (or 'image': one)")
    from rft.data.images import MARK, encode, place_images

    images = value.get("images", [value["image"]] if "image" in value else [])
    images = images if isinstance(images, (list, tuple)) else [images]
    encoded = tuple(encode(image, f"{type(env).__name__}'s observation image {i}") for i, image in enumerate(images))
    text = str(value.get("text", ""))
    if encoded and text.count(MARK) not in (0, len(encoded)):
        raise ValueError(f"{type(env).__name__} returned {len(encoded)} image(s) but its text marks "
                         f"{text.count(MARK)} with {MARK}: mark each image or none")
    return Observation(place_images(text, len(encoded), "observation") if encoded else text, encoded)


def _is_image(value: Any) -> bool:
    # an array of 2 or 3 dimensions (a numpy scalar is text, as before images)
    return isinstance(value, (bytes, bytearray)) or getattr(value, "ndim", 0) in (2, 3) or \
        type(value).__module__.startswith("PIL.")


async def reset(env: Any, task: Any, seed: int | None) -> tuple[Observation, dict]:
    """`env.reset(seed=seed, options={"task": task})`, awaited or run in a worker thread."""
    call = env.reset
    if inspect.iscoroutinefunction(call):
        out = await call(seed=seed, options={"task": task})
    else:
        out = await asyncio.to_thread(call, seed=seed, options={"task": task})
    value, info = out
    return observation(env, value), dict(info or {})


async def step(env: Any, action: str) -> tuple[Observation, float, bool, bool, dict]:
    """`env.step(action)`, awaited or run in a worker thread; checked to be Gymnasium's 5-tuple."""
    call = env.step
    out = await call(action) if inspect.iscoroutinefunction(call) else await asyncio.to_thread(call, action)
    if not isinstance(out, tuple) or len(out) != 5:
        raise TypeError(f"{type(env).__name__}.step returned {type(out).__name__} of length "
                        f"{len(out) if isinstance(out, tuple) else '?'}; expected Gymnasium's "
                        "(observation, reward, terminated, truncated, info)")
    value, reward, terminated, truncated, info = out
    return observation(env, value), float(reward), bool(terminated), bool(truncated), dict(info or {})


def make_env(spec: str, args: dict[str, Any]) -> Any:
    """An instance of the environment `spec` (name or dotted path) built with `args`."""
    cls = ENVIRONMENTS.resolve(spec)
    try:
        return cls(**args)
    except TypeError as err:
        raise ValueError(f"rollout.env={spec!r}: rollout.env_args={args!r} do not fit its constructor "
                         f"({err})") from None


def required_columns(spec: str | None) -> tuple[str, ...]:
    """The taskset columns the environment `spec` needs in every row."""
    if spec is None:
        return ()
    return tuple(getattr(ENVIRONMENTS.resolve(spec), "required_columns", ()))


def write_env_tasksets(spec: str, generate, train_path: str, eval_path: str | None, seed: int) -> None:
    """data.from_env (rft.config.EnvTasksConfig): the environment's own `sample_tasks` (train and a
    disjoint eval set) or `sample_demos` (conversations for SFT, train only), written as jsonl."""
    cls = ENVIRONMENTS.resolve(spec)
    if generate.kind == "demos":
        files = [(train_path, cls.sample_demos(generate.num_train, seed, **generate.args))]
    else:
        rows = cls.sample_tasks(generate.num_train + generate.num_eval, seed, **generate.args)
        files = [(train_path, rows[: generate.num_train])]
        if eval_path is not None:
            files.append((eval_path, rows[generate.num_train:]))
    for path, rows in files:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(path + ".tmp", path)


# the built-ins register themselves in ENVIRONMENTS when imported; importing them here makes every
# user of this package see them
from rft.explorer.envs import calculator, grid_world  # noqa: E402,F401
