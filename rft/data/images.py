"""A taskset row's images (data.image_key), for vision-language models.

A row's image column holds one image or a list of them, each in one of the layouts users have:
  - a path (relative to the taskset's folder, or absolute),
  - the encoded bytes (PNG, JPEG, ...),
  - an HF `datasets` Image feature as stored in parquet or read with decode=False:
    {"bytes": ..., "path": ...} (bytes win; a path alone is read).
An image goes where the prompt marks it: `<image>` in a text prompt (verl's and EasyR1's
convention), or a {"type": "image"} part of a message's content (the Hub's chat layout, turned
into `<image>` by rft/data/rows.py). Prompts without a mark get their images before the text. Each
mark becomes Qwen2.5-VL's placeholder, which the model's processor widens to the image's tokens.

Images are kept encoded (`Task.images`) and checked here by decoding them once: a row whose image
cannot be read, or whose marks and images differ in number, is skipped and counted as the reader
skips any bad row, never fatal.
"""

from __future__ import annotations

import io
import os
from typing import Any

MARK = "<image>"  # where a prompt's image goes
IMAGE_PAD = "<|image_pad|>"  # Qwen2.5-VL's image token: one per image in a prompt, one per merged patch in the model
PLACEHOLDER = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"


def read_images(value: Any, key: str, base_dir: str) -> tuple[bytes, ...]:
    """The encoded images of a row's image column; ValueError naming the key and the item."""
    items = value if isinstance(value, list) else [value]
    images = []
    for i, item in enumerate(items):
        where = f"image {key}[{i}]" if isinstance(value, list) else f"image {key!r}"
        data = _encoded(item, where, base_dir)
        _check_readable(data, where)
        images.append(data)
    return tuple(images)


def _encoded(item: Any, where: str, base_dir: str) -> bytes:
    if isinstance(item, dict):  # an HF datasets Image feature
        if item.get("bytes"):
            return bytes(item["bytes"])
        if item.get("path"):
            item = item["path"]
        else:
            raise ValueError(f"{where} has neither bytes nor a path")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str):
        path = item if os.path.isabs(item) else os.path.join(base_dir, item)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise ValueError(f"{where}: cannot read {path!r} ({err.strerror})") from None
    raise ValueError(f"{where} must be a path, bytes or an HF Image feature (got {type(item).__name__})")


def _check_readable(data: bytes, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # truncated files fail here, not at rollout
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise ValueError(f"{where} is not a readable image ({type(err).__name__}: {err})") from None


def place_images(text: str, count: int, key: str) -> str:
    """`text` with each `<image>` mark (or, with none, the start) holding one image's placeholder;
    ValueError when marks and images differ in number."""
    marks = text.count(MARK)
    if marks == 0:
        return PLACEHOLDER * count + text
    if marks != count:
        raise ValueError(f"the prompt marks {marks} image(s) with {MARK} but {key!r} holds {count}")
    return text.replace(MARK, PLACEHOLDER)


def encode(image: Any, where: str) -> bytes:
    """An image an environment returned, encoded as a row's images are: encoded bytes as they are
    (checked readable), a PIL image or an H x W (x C) uint8 array as PNG (lossless: the trainer
    cuts the same pixels into patches as vLLM did); ValueError naming `where` otherwise."""
    if isinstance(image, (bytes, bytearray)):
        _check_readable(bytes(image), where)
        return bytes(image)
    from PIL import Image

    if not isinstance(image, Image.Image):
        try:
            image = Image.fromarray(image)  # numpy arrays and anything with the array interface
        except (TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{where} must be encoded bytes, a PIL image or a uint8 array "
                             f"(got {type(image).__name__}: {err})") from None
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def decode(data: bytes):
    """A PIL image (RGB) from encoded bytes, as the model's processor takes it."""
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def image_processor(model_path: str):
    """The model's image processor, as vLLM loads it (transformers' AutoImageProcessor: with
    torchvision its fast one, else the PIL one), so that rollout, trainer and vLLM cut an image
    into the same patches."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_path)


def image_tokens(processor, data: bytes) -> int:
    """How many tokens an encoded image takes in the model: its patches as `processor` cuts them
    (resized to its pixel bounds), merged merge_size x merge_size. Read from the image's size alone,
    as vLLM counts placeholders (the processor's get_number_of_image_patches)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return processor.get_number_of_image_patches(height, width) // processor.merge_size ** 2


def widen(ids: list[int], pad_id: int, processor, images: list[bytes]) -> list[int]:
    """`ids` with the i-th <|image_pad|> repeated as many times as image i has tokens (its patches,
    merged merge_size x merge_size, as `processor` cuts them): the sequence the model runs on."""
    counts = iter(image_tokens(processor, image) for image in images)
    out = []
    for token in ids:
        out.extend([pad_id] * next(counts) if token == pad_id else [token])
    return out


def image_runs(ids: list[int], pad_id: int, images: int) -> list[tuple[int, int]]:
    """(start, length) of each of the first `images` runs of <|image_pad|> in widened `ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != pad_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        elif len(runs) == images:
            break
        else:
            runs.append((i, 1))
    return runs


def narrow(ids: list[int], pad_id: int, images: int) -> list[int]:
    """`widen` undone for the first `images` runs of <|image_pad|> (each as one), as vLLM is given a
    prompt: its processor widens each again (given widened ids it widened the first of them). An
    image token the policy sampled after them stays as it is."""
    out, in_image, runs = [], False, 0
    for token in ids:
        if token == pad_id and in_image:
            continue
        in_image = token == pad_id and runs < images
        runs += in_image
        out.append(token)
    return out
