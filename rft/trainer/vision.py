"""A vision-language model for the trainer: transformers' vision tower in front of rft's Megatron
decoder (Qwen2.5-VL).

The vision tower (patch embedding, windowed ViT blocks, the patch merger that projects into the
language model's width) is transformers' own module, whole on every TP rank of the first pipeline
stage; its image features take the place of the image tokens in the decoder's input embeddings,
and the decoder is the same megatron-core GPTModel as for text, with multimodal RoPE. So the
decoder keeps its tensor, pipeline and sequence parallelism and its packed microbatches unchanged,
and the vision tower (about 0.67B parameters beside a 3B or 7B decoder) costs no mapping of its
own: HF's `visual.*` tensors load by name. Megatron-Bridge's Qwen2.5-VL model is built the same way
(transformers' vision tower before a Megatron language model); megatron-core's own multimodal
`LLaVAModel` has no Qwen2.5-VL vision encoder.

Gradients of the vision tower are the same on every TP rank: the decoder's input gradient reaches
each of them whole (Megatron's TP regions all-reduce it, and under sequence parallelism the
scatter's backward all-gathers it), so the replicas stay equal without a sync of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel

from rft.trainer.chunks import model_chunks


@dataclass
class ImageInputs:
    """A microbatch's images, in the order their image tokens appear (sequence by sequence):
    the processor's flattened patches and each image's (t, h, w) grid of patches."""

    pixel_values: torch.Tensor  # [patches, channels x temporal patch x patch x patch]
    grid_thw: torch.Tensor  # [images, 3] int64
    at: torch.Tensor | None = None  # a microbatch's: [b, s] bool, the tokens whose embeddings are image features

    def to(self, device: torch.device) -> "ImageInputs":
        return ImageInputs(self.pixel_values.to(device), self.grid_thw.to(device),
                           None if self.at is None else self.at.to(device))


class VisionLanguageGPT(GPTModel):
    """Megatron's GPTModel (multimodal RoPE) with a vision tower on the first pipeline stage
    (`vision`, transformers' module). `forward(..., images=ImageInputs)` embeds the tokens,
    puts the image features in place of the image tokens and runs the decoder on that."""

    def __init__(self, *args, vision_config=None, image_token_id: int = -1, image_processor=None, **kwargs):
        # the embedding is scattered over the sequence-parallel ranks here, after the image
        # features are in: Megatron's embedding would scatter the token embeddings alone
        super().__init__(*args, scatter_embedding_sequence_parallel=False, **kwargs)
        self.image_token_id = image_token_id
        # what every stage needs to lay out a microbatch's positions (forward.pack_microbatch's `mrope`)
        self.mrope = (image_token_id, vision_config.spatial_merge_size)
        self.image_processor = image_processor  # encoded images -> patches, as vLLM makes them
        if self.pre_process:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

            self.vision = Qwen2_5_VisionTransformerPretrainedModel._from_config(
                vision_config, dtype=self.config.params_dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, decoder_input=None,
                images: ImageInputs | None = None, **kwargs):
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, images)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    def embed(self, input_ids: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """The decoder's input [s, b, h] (sequence parallel: this rank's [s/TP, b, h]): token
        embeddings, image features at the image tokens."""
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole on every TP rank
        if images is not None:
            features = self.vision(images.pixel_values.to(embeddings.dtype), grid_thw=images.grid_thw).pooler_output
            at_images = images.at.unsqueeze(-1)  # [b, s, 1]: the prompts' image tokens, not a sampled one
            if int(at_images.sum()) != features.shape[0]:
                raise ValueError(f"{int(at_images.sum())} image tokens in the microbatch but its images make "
                                 f"{features.shape[0]} features: a prompt's image tokens and its images differ")
            # filled row by row, as the features come: [b, s, h] order, not the decoder's [s, b, h]
            embeddings = embeddings.transpose(0, 1).masked_scatter(at_images, features.to(embeddings.dtype))
            embeddings = embeddings.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
        return embeddings


def image_processor_of(model):
    """A vision-language trainer model's image processor (the one vLLM uses: rft/data/images.py),
    None for a language model."""
    return getattr(model_chunks(model)[0], "image_processor", None)


def image_inputs(model, images: list[bytes]) -> ImageInputs:
    """A row's encoded images as the vision tower's input, cut into patches by the model's image
    processor."""
    from rft.data.images import decode

    found = image_processor_of(model)(images=[decode(image) for image in images], return_tensors="pt")
    return ImageInputs(found["pixel_values"], found["image_grid_thw"])


def freeze_vision(model) -> int:
    """trainer.freeze_vision: the vision tower's parameters take no gradient (the optimizer, the
    master weights and the gradient all-reduce only see parameters that do); returns how many."""
    frozen = 0
    for chunk in model_chunks(model):
        if hasattr(chunk, "vision"):
            chunk.vision.requires_grad_(False)
            frozen += sum(p.numel() for p in chunk.vision.parameters())
    return frozen


def mrope_of(model) -> tuple[int, int] | None:
    """(image token id, merge size) of a vision-language trainer model (any stage, any chunk), None
    for a language model: what `pack_microbatch` needs for multimodal RoPE positions."""
    return getattr(model_chunks(model)[0], "mrope", None)


def mrope_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE positions [3, len(ids)] of one sequence (temporal, height, width), as
    transformers' Qwen2.5-VL computes them for images, and which tokens hold image features
    [len(ids)] bool. Text tokens count on by one in all three; an image's tokens (its grid merged
    `merge_size` x `merge_size`, the first image tokens not yet taken) take the position where it
    starts plus their row and column, and the text after it goes on from past the image's larger
    side. An image token after the images (one the policy sampled) is text, as vLLM reads it.
    Written out here rather than calling transformers' `get_rope_index`: that one works on a
    padded batch and its arguments changed within transformers 5; a packed microbatch needs each
    sequence's positions from 0."""
    pieces, at_image, position, i, taken = [], [], 0, 0, 0
    while i < len(ids):
        if ids[i] == image_token_id and taken < len(grids):
            t, h, w = grids[taken]
            h, w, taken = h // merge_size, w // merge_size, taken + 1
            if ids[i: i + t * h * w] != [image_token_id] * (t * h * w):
                raise ValueError(f"an image of {t * h * w} tokens, but its run of image tokens at {i} is shorter")
            block = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            pieces.append(block.reshape(3, -1) + position)
            at_image += [True] * (t * h * w)
            position, i = position + max(h, w), i + t * h * w
            continue
        run = i + 1  # text up to the next image's first token
        while run < len(ids) and not (ids[run] == image_token_id and taken < len(grids)):
            run += 1
        pieces.append(torch.arange(position, position + run - i).expand(3, -1))
        at_image += [False] * (run - i)
        position, i = position + run - i, run
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=torch.int64)
    return positions, torch.tensor(at_image, dtype=torch.bool)
