"""Environments that show the model images (rft/explorer/envs/__init__.py's observations) and the
conversation they join (rft/explorer/model_client.py): what an observation may be, an image never
cut in two by the context, the per-trajectory image limit, and a text model refusing images. The
real engine's episode is tests/dist/test_vision_language_parallel.py's."""

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from rft.data.images import PLACEHOLDER, decode
from rft.explorer import envs
from rft.explorer.model_client import Conversation
from tests.unit.test_vision_language import _image, model_dir  # noqa: F401  (the tiny VL model fixture)


class Shows:
    """Stands for an environment in error messages."""


def test_an_observation_may_be_text_an_image_or_text_with_images():
    red, blue = _image(56, 56, "red"), np.asarray(_image(112, 56, "blue"))
    assert envs.observation(Shows(), "at 2 3") == envs.Observation("at 2 3")
    assert envs.observation(Shows(), np.int64(3)) == envs.Observation("3")  # a numpy scalar stays text
    assert envs.observation(Shows(), {"x": 1}) == envs.Observation("{'x': 1}")  # as any other dict
    assert envs.observation(Shows(), {"text": "at 2 3"}) == envs.Observation("at 2 3")
    alone = envs.observation(Shows(), red)
    assert alone.text == PLACEHOLDER and decode(alone.images[0]).getpixel((10, 10)) == red.getpixel((10, 10))
    marked = envs.observation(Shows(), {"text": "a <image> and <image>?", "images": [red, blue]})
    assert marked.text == f"a {PLACEHOLDER} and {PLACEHOLDER}?" and len(marked.images) == 2
    assert decode(marked.images[1]).size == (112, 56)  # the array's H x W x 3, kept lossless (PNG)
    unmarked = envs.observation(Shows(), {"text": "which?", "image": marked.images[0]})  # encoded bytes too
    assert unmarked == envs.Observation(PLACEHOLDER + "which?", marked.images[:1])


@pytest.mark.parametrize("value, message", [
    ({"text": "x", "picture": 1}, "Shows returned an observation with keys"),
    ({"text": "<image> <image>", "image": Image.new("RGB", (28, 28))}, "returned 1 image.* marks 2"),
    ({"images": [b"not an image"]}, "Shows's observation image 0 is not a readable image"),
    ({"images": [{"nested": 1}]}, "Shows's observation image 0 must be encoded bytes, a PIL image or a uint8 array"),
])
def test_a_bad_observation_is_named_with_its_environment(value, message):
    with pytest.raises(ValueError, match=message):
        envs.observation(Shows(), value)


def _client(model_dir: str, context: int, images_per_prompt: int = 4, reads_images: bool = True):  # noqa: F811
    """What a Conversation uses of its ModelClient, with the tiny VL model's tokenizer and image
    processor (the engine's own are these)."""
    from transformers import AutoTokenizer

    from rft.data.chat_format import PlainFormat
    from rft.data.images import IMAGE_PAD, image_processor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = SimpleNamespace(images=reads_images, images_per_prompt=images_per_prompt,
                             image_pad=tokenizer.convert_tokens_to_ids(IMAGE_PAD),
                             image_processor=image_processor(model_dir))
    return SimpleNamespace(format=PlainFormat(tokenizer), engine=engine, context=context)


def _png(width: int, height: int) -> bytes:
    return envs.observation(Shows(), _image(width, height, "green")).images[0]


def test_an_image_that_does_not_fit_the_context_is_left_out_whole(model_dir):  # noqa: F811
    client = _client(model_dir, context=30)
    convo = Conversation(client, [{"role": "user", "content": PLACEHOLDER + "go"}], (_png(56, 56),))
    pad = client.engine.image_pad
    assert convo.token_ids.count(pad) == 4 and convo.image_spans == [(convo.token_ids.index(pad), 4)]
    small, large = _png(56, 56), _png(112, 112)  # 4 and 16 tokens: only the first fits in 30
    convo.add({"role": "user", "content": f"a{PLACEHOLDER}b{PLACEHOLDER}c"}, images=(small, large))
    assert convo.finish_reason == "context" and len(convo.images) == 2 and [width for _, width in convo.image_spans] == [4, 4]
    assert convo.token_ids.count(pad) == 8 and convo.token_ids[-1] != pad  # cut before the large image's tokens
    assert convo.room >= 0 and len(convo.loss_mask) == len(convo.token_ids)
    wide = Conversation(client, [{"role": "user", "content": "go" * 8}])
    wide.add({"role": "user", "content": PLACEHOLDER}, images=(large,))
    assert wide.images == [] and pad not in wide.token_ids


def test_images_beyond_the_limit_and_images_for_a_text_model_are_refused(model_dir):  # noqa: F811
    convo = Conversation(_client(model_dir, context=200, images_per_prompt=1),
                         [{"role": "user", "content": PLACEHOLDER}], (_png(56, 56),))
    with pytest.raises(ValueError, match="rollout.images_per_prompt=1"):
        convo.add({"role": "user", "content": PLACEHOLDER}, images=(_png(56, 56),))
    with pytest.raises(ValueError, match="model that reads none"):
        Conversation(_client(model_dir, context=200, reads_images=False),
                     [{"role": "user", "content": PLACEHOLDER}], (_png(56, 56),))


def test_the_context_check_counts_an_image_as_its_tokens_and_never_truncates_an_image_row(model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    from rft.data.context_fit import ContextFit
    from rft.data.images import image_processor
    from rft.data.taskset import Task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tasks = [Task(index=i, prompt=PLACEHOLDER + "colour?", answer="red", images=(image,))
             for i, image in enumerate((_png(56, 56), _png(112, 112)))]  # 4 and 16 image tokens
    text = len(tokenizer(PLACEHOLDER + "colour?")["input_ids"])  # the placeholder's 3 tokens, the text's
    for policy in ("skip", "truncate_left"):
        fit = ContextFit(tokenizer, False, context=text - 1 + 4 + 2, policy=policy,
                         image_processor=image_processor(model_dir))
        rows: dict = {}
        assert [t.index for t in fit.for_rollouts(tasks, "t.jsonl", 2, rows)] == [0], policy
        assert rows["t.jsonl"] == {"overlong_skipped": 1, "truncated": 0}
