"""Synthetic image tasksets for vision-language models: one coloured shape (circle, square or
triangle) on a white picture, drawn with Pillow; the question asks its colour, the answer is the
colour's name. The quickstart_vl recipe's data (data.shapes), generated with a fixed seed.

The colour is only in the image: the prompt is the same for every row, so a model that answers
better than chance reads the image. Train and eval pictures are drawn independently (positions,
sizes, shapes vary; no picture repeats across them in practice).
"""

from __future__ import annotations

import json
import os

import numpy as np

from rft.config import ShapesTaskConfig

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
QUESTION = "<image>colour?"  # the image's placeholder goes at <image> (rft/data/images.py)


def _draw(rng: np.random.Generator, size: int, colour: tuple[int, int, int]):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    side = int(rng.integers(size // 3, size * 2 // 3))
    x, y = (int(v) for v in rng.integers(0, size - side, 2))
    shape = ("circle", "square", "triangle")[int(rng.integers(3))]
    if shape == "circle":
        draw.ellipse((x, y, x + side, y + side), fill=colour)
    elif shape == "square":
        draw.rectangle((x, y, x + side, y + side), fill=colour)
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=colour)
    return image


def write_shapes_tasksets(cfg: ShapesTaskConfig, train_path: str, eval_path: str, seed: int) -> None:
    """Write the train and eval jsonl files, their pictures in an `images` folder beside each
    (rows name them relative to it, as data.image_key reads them)."""
    rng = np.random.default_rng(seed)
    names = sorted(COLOURS)
    for path, count, split in ((train_path, cfg.num_train, "train"), (eval_path, cfg.num_eval, "eval")):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(os.path.join(folder, "images"), exist_ok=True)
        rows = []
        for i in range(count):
            name = names[int(rng.integers(len(names)))]
            picture = f"images/{split}{i:05d}.png"
            _draw(rng, cfg.image_size, COLOURS[name]).save(os.path.join(folder, picture))
            rows.append({"question": QUESTION, "answer": name, "images": [picture]})
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)
