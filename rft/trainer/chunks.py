"""A trainer model's GPTModel chunks: one, or one pipeline stage's virtual stages. Apart from
rft/trainer/model.py, which builds them, so that modules model.py imports (vision.py) walk them too."""

from __future__ import annotations

import torch


class VirtualStages(torch.nn.Module):
    """One pipeline stage's model chunks under Megatron's virtual pipeline: with P stages and V
    chunks each, chunk v of stage p holds the layers of virtual stage v * P + p, so a microbatch
    crosses every stage V times and Megatron's interleaved schedule keeps the pipeline's bubble
    1/V as long. The embedding lives in chunk 0 of the first stage, the output layer in the last
    chunk of the last stage. Parameter names are the chunks' own under `chunks.<v>.`;
    `model_chunks` and `named_chunks` are how the rest of the trainer walks them."""

    def __init__(self, chunks: list[torch.nn.Module]):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)

    @property
    def config(self):
        return self.chunks[0].config

    @property
    def pre_process(self) -> bool:  # this stage holds the embedding
        return self.chunks[0].pre_process

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.chunks[0].share_embeddings_and_output_weights


def named_chunks(model) -> list[tuple[str, torch.nn.Module]]:
    """(prefix of its parameter names in `model`, chunk) for each GPTModel chunk a trainer model is
    made of: itself, or its virtual stages' chunks."""
    if isinstance(model, VirtualStages):
        return [(f"chunks.{v}.", chunk) for v, chunk in enumerate(model.chunks)]
    return [("", model)]


def model_chunks(model) -> list[torch.nn.Module]:
    """The GPTModel chunks a trainer model is made of (`named_chunks` without the prefixes)."""
    return [chunk for _, chunk in named_chunks(model)]
