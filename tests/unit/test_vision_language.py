"""A Qwen2.5-VL-shaped model in the trainer (rft/trainer/vision.py) on one CPU gloo rank: the tiny
vision-language model (rft/models/tiny.py, `vision`) scores sequences with images of two sizes and
one without as transformers does, padded and packed; its HF weights go in and come out bit for bit;
multimodal RoPE's positions are transformers' own."""

import pytest
import torch
from PIL import Image, ImageDraw

from rft.config import TinyModelConfig
from rft.models.tiny import create_tiny_model
from rft.runtime.topology import free_port
from tests.ranks import start_ranks
from tests.unit.one_rank import init_one_rank


def _image(width: int, height: int, colour: str) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).ellipse((4, 4, width // 2, height // 2), fill=colour)
    return image


def _encoded(pictures: list) -> list:
    """Each row's PIL images as PNG bytes (as experience rows and StepBatch hold them), None for none."""
    import io

    rows = []
    for row in pictures:
        encoded = []
        for picture in row:
            out = io.BytesIO()
            picture.save(out, format="PNG")
            encoded.append(out.getvalue())
        rows.append(encoded or None)
    return rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return create_tiny_model(TinyModelConfig(vision=True), str(tmp_path_factory.mktemp("vl") / "model"), seed=0)


def _sequences(model_dir: str, with_pictures: bool = False):
    """(prompts, responses, per-sequence ImageInputs or None): two prompts with an image each (4
    and 8 image tokens) and one of text alone; `with_pictures`: and each sequence's PIL images."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rft.trainer.vision import ImageInputs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    start, end, pad = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    prompts, images, pictures = [], [], []
    for text, image in (("red?", _image(56, 56, "red")), ("blue?", _image(112, 56, "blue")), ("1+2=", None)):
        ids = [tokenizer.bos_token_id]
        if image is not None:
            found = processor(images=[image], return_tensors="pt")
            images.append(ImageInputs(found["pixel_values"], found["image_grid_thw"]))
            ids += [start] + [pad] * int(found["image_grid_thw"].prod() // 4) + [end]
        else:
            images.append(None)
        prompts.append(ids + tokenizer.encode(text, add_special_tokens=False))
        pictures.append([image] if image is not None else [])
    responses = [tokenizer.encode(r, add_special_tokens=False) for r in ("yes", "no", "3")]
    return (prompts, responses, images, pictures) if with_pictures else (prompts, responses, images)


def _worker(rank: int, port: int, model_dir: str, out: str, prompts, responses, images) -> None:
    from rft.trainer.forward import logprobs_from_logits, model_forward, pack_microbatch
    from rft.trainer.hf_weights import export_hf_weights, load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state

    init_one_rank(port)
    model, geo = build_gpt_model(model_dir)
    state = load_hf_state(model_dir)
    load_hf_weights(model, state, geo)
    mrope = (model.image_token_id, model.vision.spatial_merge_size)
    result = {}
    with torch.no_grad():
        for packed in (False, True):
            mb = pack_microbatch(prompts, responses, 0, torch.device("cpu"), packed=packed, images=images, mrope=mrope)
            result[f"logprobs_{packed}"] = logprobs_from_logits(model_forward(model, mb), mb, with_entropy=False)[0]
            result[f"positions_{packed}"] = mb.position_ids
        result["mask"] = mb.loss_mask
    exported = dict(export_hf_weights(model, geo))
    result["exact"] = sorted(exported) == sorted(state) and all(torch.equal(exported[n], state[n]) for n in state)
    result["vision_parameters"] = sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision."))
    torch.save(result, out)


def _hub_flat_layout(model_dir: str, out: str) -> str:
    """A copy of the model whose config.json is in the layout the Hub's Qwen2.5-VL files have
    (written by transformers 4.x): the language model's keys at the top level, not under
    `text_config`, and multimodal RoPE as `rope_scaling` {type: mrope}, `rope_theta` beside it."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    with open(f"{out}/config.json") as f:
        config = json.load(f)
    text = {k: v for k, v in config.pop("text_config").items() if k not in ("model_type", "layer_types")}
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    with open(f"{out}/config.json", "w") as f:
        json.dump({**text, **config}, f, indent=1)
    return out


@pytest.mark.parametrize("layout", ["transformers 5", "the Hub's flat"])
def test_the_trainer_scores_image_prompts_as_transformers_and_maps_weights_exactly(model_dir, tmp_path, layout):
    from transformers import Qwen2_5_VLForConditionalGeneration

    if layout != "transformers 5":
        model_dir = _hub_flat_layout(model_dir, str(tmp_path / "flat"))
    prompts, responses, images = _sequences(model_dir)
    out = str(tmp_path / "out.pt")
    start_ranks(_worker, 1, free_port(), model_dir, out, prompts, responses, images)
    result = torch.load(out)
    assert result["exact"]  # HF -> Megatron -> HF, the vision tower's tensors included
    assert result["vision_parameters"] > 0

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    image_token = hf.config.image_token_id
    for row, (p, r, im) in enumerate(zip(prompts, responses, images)):
        ids = torch.tensor([p + r])
        kwargs = {} if im is None else {"pixel_values": im.pixel_values, "image_grid_thw": im.grid_thw}
        with torch.no_grad():
            out_hf = hf(input_ids=ids, mm_token_type_ids=(ids == image_token).int(), **kwargs)
        # the image changes what follows it: without its features the logits are another model's
        logprobs = torch.log_softmax(out_hf.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        targets = result["mask"][row].nonzero()[:, 0]
        for packed in (False, True):
            ours = result[f"logprobs_{packed}"][row, targets]
            assert torch.allclose(ours, logprobs[targets], atol=1e-4), (row, packed, ours, logprobs[targets])
        if im is not None:  # multimodal RoPE positions as transformers' get_rope_index gives them
            positions, _ = hf.model.get_rope_index(ids, (ids == image_token).int(), image_grid_thw=im.grid_thw)
            assert torch.equal(result["positions_False"][:, row, : ids.shape[1]], positions[:, 0])


def test_an_image_changes_the_scores_after_it(model_dir):
    """The check above would pass for a trainer that dropped the image features if they changed
    nothing: two images of one prompt give different next-token logprobs in transformers."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    prompts, responses, images = _sequences(model_dir)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompts[0] + responses[0]])
    other = _image(56, 56, "green")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    found = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[other], return_tensors="pt")
    with torch.no_grad():
        a = hf(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(),
               pixel_values=images[0].pixel_values, image_grid_thw=images[0].grid_thw).logits
        b = hf(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int(),
               pixel_values=found["pixel_values"], image_grid_thw=found["image_grid_thw"]).logits
    assert (a[0, -1] - b[0, -1]).abs().max() > 1e-3


def test_an_image_token_the_policy_sampled_after_the_images_is_text():
    """vLLM marks image tokens where its processor put them; one the model samples later is text.
    The trainer agrees: after the images' own tokens, an image token counts on as text."""
    from rft.trainer.vision import mrope_positions

    pad = 9
    ids = [1, 2, pad, pad, pad, pad, 3, 4, pad, 5]  # a 4 x 4 patch grid merged 2 x 2: 4 tokens, then a sampled pad
    positions, at_image = mrope_positions(ids, [(1, 4, 4)], pad, 2)
    assert at_image.tolist() == [False, False, True, True, True, True, False, False, False, False]
    assert positions[:, 2:6].tolist() == [[2, 2, 2, 2], [2, 2, 3, 3], [2, 3, 2, 3]]
    assert positions[:, 6:].tolist() == [[4, 5, 6, 7]] * 3  # on from past the image's larger side (2)


def _frozen_step(rank: int, port: int, model_dir: str, out: str, prompts, responses, encoded) -> None:
    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step
    from rft.trainer.vision import freeze_vision

    init_one_rank(port)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    frozen = freeze_vision(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.SGD(masters, lr=0.5))
    train_step(model, optimizer, StepBatch(prompt_ids=prompts, response_ids=responses, images=encoded),
               AlgorithmConfig(name="sft", grad_clip=0.0), 3, 0)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    torch.save({"frozen": frozen, "moved": moved, "names": set(before)}, out)


def test_a_frozen_vision_tower_keeps_its_weights_while_the_language_model_trains(model_dir, tmp_path):
    prompts, responses, _, pictures = _sequences(model_dir, with_pictures=True)
    out = str(tmp_path / "out.pt")
    start_ranks(_frozen_step, 1, free_port(), model_dir, out, prompts, responses, _encoded(pictures))
    result = torch.load(out)
    vision = {n for n in result["names"] if n.startswith("vision.")}
    assert result["frozen"] > 0 and vision
    assert not result["moved"] & vision  # the tower kept its weights
    assert any(n.startswith("decoder.") for n in result["moved"])  # the language model trained


def test_freeze_vision_is_refused_for_a_model_without_a_vision_tower():
    from tests.unit.test_config import compose_cfg

    from rft.config.checks import validate

    cfg = compose_cfg("+experiment=quickstart", "trainer.freeze_vision=true")
    with pytest.raises(ValueError, match=r"trainer.freeze_vision=True is invalid: model tiny-qwen2 has no vision tower"):
        validate(cfg)
    validate(compose_cfg("+experiment=quickstart_vl", "trainer.freeze_vision=true"))


def test_vllm_is_given_one_image_token_per_image_and_a_sampled_image_token_as_it_is():
    """`narrow` undoes the widening of the images' own runs only: a run of image tokens the policy
    sampled after them (a multi-turn conversation's, a cut sample's continuation) reaches vLLM as
    the trainer scores it."""
    from rft.data.images import narrow

    pad = 9
    assert narrow([1, 7, pad, pad, pad, pad, 8, 3, 7, pad, pad, 8, 4, pad, pad], pad, 2) == [1, 7, pad, 8, 3, 7, pad, 8, 4,
                                                                                           pad, pad]
    assert narrow([1, pad, pad, 2], pad, 0) == [1, pad, pad, 2]
