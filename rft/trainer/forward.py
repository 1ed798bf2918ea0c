"""Forward passes for training: padded or packed microbatches in, per-token logprobs and entropy out.

Logits stay vocab-parallel (each TP rank holds V/TP columns); logprob and entropy are reduced
across the TP group with Megatron's reduce-from-TP-region (all-reduce forward, identity backward:
every TP rank computes the same loss, so summing gradients as well would scale them by TP), so
nothing ever materialises [b, s, V] on one rank when TP > 1.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rft.trainer.routing_replay import microbatch_routes, replaying


@dataclass
class Microbatch:
    """Sequences for one forward/backward, padded or packed.

    Padded: one row per sequence, right-padded; causal attention alone keeps real tokens off the
    padding after them. Packed (`row_index` set): all sequences in one row back to back, and
    `packed_seq_params` (Megatron's THD layout: cumulative sequence lengths) keeps each sequence's
    attention and rotary positions to itself (rft/trainer/attention.py), so packed and padded give
    the same logits. What the loss side sees is the padded layout either way: `rows()` maps per-target
    values of the packed row to one row per sequence, and `loss_mask` is in that layout.
    `loss_mask[i, t]` is 1 where token t+1 of sequence i is a response token to train.
    """

    input_ids: torch.Tensor  # [b, s] int64 (packed: [1, total tokens])
    loss_mask: torch.Tensor  # [sequences, longest - 1] float: scores targets input_ids[:, 1:] (per sequence)
    position_ids: torch.Tensor  # like input_ids; restart at 0 for each packed sequence
    packed_seq_params: object | None = None  # packed: megatron's PackedSeqParams (qkv_format "thd")
    row_index: torch.Tensor | None = None  # packed: [sequences, longest - 1] target positions in the row, -1 = none
    # positions (row-major over input_ids) that predict a response token, whatever its loss mask:
    # the only logits a policy's loss, old logprobs or reference logprobs read
    response_targets: torch.Tensor | None = None
    # routing replay: the experts each token goes to, [layers, tokens, k] in the routers' order
    # (rft/trainer/routing_replay.py); None: the routers choose
    expert_routes: torch.Tensor | None = None
    # a vision-language model's images (rft/trainer/vision.py), in the order of their image tokens;
    # position_ids are then multimodal RoPE's [3, b, s]
    images: object | None = None

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-target values [b, s-1] of the model's layout in the padded layout (0 on padding)."""
        if self.row_index is None:
            return values
        valid = self.row_index >= 0
        return torch.where(valid, values[0][self.row_index.clamp(min=0)], torch.zeros((), dtype=values.dtype,
                                                                                       device=values.device))


def _loss_mask(prompts: list[list[int]], responses: list[list[int]], width: int,
               response_masks: list[list[int]] | None) -> torch.Tensor:
    """[sequences, width - 1]: 1 at the targets of the response tokens to train (every response
    token, or those whose `response_masks` entry is 1: a multi-turn trajectory's response holds
    tool output and environment messages the policy did not sample)."""
    mask = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        # target index t predicts token t+1; response tokens sit at [len(p), len(p)+len(r))
        if response_masks is None:
            mask[row, len(p) - 1: len(p) + len(r) - 1] = 1.0
        else:
            mask[row, len(p) - 1: len(p) + len(r) - 1] = torch.tensor(response_masks[row], dtype=torch.float32)
    return mask


def sequence_multiple(model) -> int:
    """What a microbatch's sequence length must be a multiple of: TP under sequence parallelism
    (each TP rank holds an equal slice of the sequence), else 1."""
    config = model.config
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def pack_microbatch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                    device: torch.device, response_masks: list[list[int]] | None = None,
                    packed: bool = False, multiple_of: int = 1, routes: list | None = None,
                    images: list | None = None, mrope: tuple[int, int] | None = None) -> Microbatch:
    """Prompt + response per sequence, right-padded (or, `packed`, back to back in one row), the
    row's length padded up to `multiple_of` (`sequence_multiple`). `routes`: each sequence's
    routed experts [tokens, layers, k] to replay (routing_replay.py). `mrope` (a vision-language
    model's image token id and merge size): multimodal RoPE positions, and `images` each
    sequence's `ImageInputs` or None (rft/trainer/vision.py)."""
    mb = _laid_out(prompts, responses, pad_id, device, response_masks, packed, multiple_of)
    if routes is not None:
        mb.expert_routes = microbatch_routes(routes, [len(p) + len(r) for p, r in zip(prompts, responses)],
                                             mb.input_ids.shape[1], packed, device)
    if mrope is not None:
        _with_images(mb, [p + r for p, r in zip(prompts, responses)], images or [None] * len(prompts), *mrope)
    return mb


def _with_images(mb: Microbatch, sequences: list[list[int]], images: list, image_token_id: int,
                 merge_size: int) -> None:
    """Multimodal RoPE positions [3, b, s] in `mb`'s layout (each sequence's from 0; padding and a
    packed row's filler count on from 0, as in the 1D layout) and its sequences' images, joined."""
    from rft.trainer.vision import ImageInputs, mrope_positions

    laid_out = [mrope_positions(ids, [tuple(g) for g in (im.grid_thw.tolist() if im is not None else [])],
                                image_token_id, merge_size) for ids, im in zip(sequences, images)]
    width = mb.input_ids.shape[1]
    if mb.packed_seq_params is None:
        positions = mb.position_ids.cpu()[None].repeat(3, 1, 1)
        at = torch.zeros(mb.input_ids.shape, dtype=torch.bool)
        for row, (found, at_image) in enumerate(laid_out):
            positions[:, row, : found.shape[1]] = found
            at[row, : len(at_image)] = at_image
    else:
        joined = torch.cat([found for found, _ in laid_out], dim=1)
        filler = width - joined.shape[1]
        positions = torch.cat([joined, torch.arange(filler).expand(3, -1)], dim=1)[:, None, :]
        at = torch.cat([at_image for _, at_image in laid_out] + [torch.zeros(filler, dtype=torch.bool)])[None]
    mb.position_ids = positions.contiguous().to(mb.input_ids.device)
    present = [im for im in images if im is not None]
    if present:
        mb.images = ImageInputs(torch.cat([im.pixel_values for im in present]),
                                torch.cat([im.grid_thw for im in present]), at).to(mb.input_ids.device)


def _laid_out(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: torch.device,
              response_masks: list[list[int]] | None, packed: bool, multiple_of: int) -> Microbatch:
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths) if packed else _round_up(max(lengths), multiple_of)  # of the padded layout
    mask = _loss_mask(prompts, responses, width, response_masks).to(device)
    # where each sequence starts in input_ids, flattened: row starts (padded) or offsets in the one row (packed)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0) if packed else torch.arange(len(lengths)) * width
    targets = torch.cat([torch.arange(len(p) - 1, len(p) + len(r) - 1) + start
                         for p, r, start in zip(prompts, responses, starts.tolist())]).to(device)
    if packed:
        return _packed(prompts, responses, lengths, starts, mask, targets, device, pad_id, multiple_of)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        ids[row, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.int64)
    positions = torch.arange(width, dtype=torch.int64).unsqueeze(0).expand(len(prompts), -1)
    return Microbatch(ids.to(device), mask, positions.contiguous().to(device), response_targets=targets)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _packed(prompts: list[list[int]], responses: list[list[int]], lengths: list[int], starts: torch.Tensor,
            mask: torch.Tensor, targets: torch.Tensor, device: torch.device, pad_id: int,
            multiple_of: int) -> Microbatch:
    ids = torch.tensor([t for p, r in zip(prompts, responses) for t in p + r], dtype=torch.int64)
    total, width = len(ids), max(lengths)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.arange(total) - starts[sequence]
    # sequence i's target t (predicting its token t+1) sits at starts[i] + t of the packed row
    t = torch.arange(width - 1)
    row_index = torch.where(t[None, :] < torch.tensor(lengths)[:, None] - 1, starts[:, None] + t[None, :], -1)
    filler = _round_up(total, multiple_of) - total  # a sequence of its own: no real token attends to it
    if filler:
        ids = torch.cat([ids, torch.full((filler,), pad_id, dtype=torch.int64)])
        positions = torch.cat([positions, torch.arange(filler)])
    return Microbatch(ids[None].to(device), mask, positions[None].to(device),
                      thd_params(lengths + ([filler] if filler else []), device), row_index.to(device), targets)


def thd_params(lengths: list[int], device: torch.device):
    """Megatron's PackedSeqParams for sequences of `lengths` back to back in one row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    longest = max(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _tp_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    from megatron.core.tensor_parallel.mappings import (
        reduce_from_tensor_model_parallel_region,
    )

    return reduce_from_tensor_model_parallel_region(t, group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group,
                            vocab_start: int, with_entropy: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy per position from vocab-parallel logits [b, s, V/tp]."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    global_max = local_max
    if tp_group is not None:  # a constant shift (no gradient), identical on every TP rank
        global_max = local_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - global_max
    exp = shifted.exp()
    sum_exp = _tp_sum(exp.sum(dim=-1), tp_group)
    log_z = sum_exp.log()
    local = targets - vocab_start
    in_range = (local >= 0) & (local < logits.shape[-1])
    picked = torch.gather(shifted, -1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _tp_sum(picked * in_range, tp_group)
    logprobs = picked - log_z
    entropy = None
    if with_entropy:
        # H = log Z - E_p[shifted logit]
        expected = _tp_sum((exp * shifted).sum(dim=-1), tp_group)
        entropy = log_z - expected / sum_exp
    return logprobs, entropy


def gather_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """This TP rank's slice [s/TP, b, h] of sequence-parallel hidden states -> all of it [s, b, h],
    for a consumer that then computes the same thing on every TP rank (its gradient into `hidden`
    is complete on each rank, so backward keeps this rank's slice instead of summing them)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
    )

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                group=parallel_state.get_tensor_model_parallel_group())


@contextmanager
def _output_layer_at(model, positions: torch.Tensor | None):
    """While open, the model's output layer sees only the hidden states at `positions` (row-major
    over [b, s]), so the model returns logits [1, len(positions), V/tp]. Under sequence
    parallelism the sequence is gathered first, and the layer, told it is not sequence-parallel
    for the while, all-reduces its input's gradient (as Megatron does to take only the last
    token's logits in inference)."""
    if positions is None or not model.post_process:
        yield
        return
    layer = model.output_layer
    sequence_parallel = layer.sequence_parallel

    def select(_module, args):
        hidden = args[0]  # [s, b, h] ([s/TP, b, h] sequence-parallel)
        if sequence_parallel:
            hidden = gather_sequence(hidden)
        picked = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[positions]
        return (picked.unsqueeze(1), *args[1:])

    handle = layer.register_forward_pre_hook(select)
    layer.sequence_parallel = False
    try:
        yield
    finally:
        layer.sequence_parallel = sequence_parallel
        handle.remove()


@contextmanager
def _fused_output_layer(model, targets: torch.Tensor, chunk: int, with_entropy: bool):
    """While open, the model's output layer returns, instead of logits, each position's (logprob
    of `targets`, entropy) [n, 1, 2], computed `chunk` positions at a time
    (rft/trainer/chunked_logprob.py): the model returns [1, n, 2] and no [n, V/tp] logits exist.
    Its input is what `_output_layer_at` selected; under TP it enters as Megatron's column-parallel
    layer takes it (identity forward, its gradient all-reduced)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
    )

    from rft.trainer.chunked_logprob import chunked_logprobs

    layer = model.output_layer
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None

    def fused(hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight  # (tied embeddings: the embedding's)
        hidden = hidden.squeeze(1) if tp == 1 else copy_to_tensor_model_parallel_region(hidden.squeeze(1))
        logprobs, entropy = chunked_logprobs(
            hidden, weight, targets, vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
            real_vocab=getattr(model, "real_vocab_size", None), group=group, chunk=chunk, with_entropy=with_entropy)
        entropy = torch.zeros_like(logprobs) if entropy is None else entropy
        return torch.stack([logprobs, entropy], dim=-1)[:, None], None

    layer.forward = fused  # an instance attribute: nn.Module.__call__ still runs the selecting hook first
    try:
        yield
    finally:
        del layer.forward


def model_forward(model, mb: Microbatch, response_only: bool = False, fused_chunk: int = 0,
                  with_entropy: bool = True) -> torch.Tensor:
    """Logits [b, s, V/tp] on the last pipeline stage, hidden states [s, b, h] on the others.
    `response_only`: logits at `mb.response_targets` alone, [1, targets, V/tp]. On SmolLM2's 49k
    vocabulary the output layer is a fifth of the model's multiply-adds per position, and a
    softmax over the whole vocabulary follows it; the prompt's and the padding's logits were
    computed and never read (tools/bench_train_vs_hf.py: a GRPO train step 15.5 -> 12.6 s).

    Columns of the vocabulary padding (Megatron pads it to a multiple of TP) get a logit that
    no softmax sees, so probabilities are over the model's real vocabulary, as in HF and vLLM.

    `fused_chunk` > 0 (with `response_only`): the output layer, the logprobs of the response
    targets and their entropy in chunks of that many positions; returns [1, targets, 2]
    (logprob, entropy) instead of logits (`_fused_output_layer`).
    """
    from contextlib import nullcontext

    from megatron.core import parallel_state

    fused = fused_chunk > 0 and response_only and model.post_process
    output_layer = _fused_output_layer(model, response_tokens(mb), fused_chunk, with_entropy) if fused \
        else nullcontext()
    with _output_layer_at(model, mb.response_targets if response_only else None), output_layer, \
            replaying(model, mb.expert_routes):
        # attention is causal by construction (rft/trainer/attention.py): no mask to build or pass
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                    packed_seq_params=mb.packed_seq_params, **({"images": mb.images} if mb.images is not None else {}))
    real_vocab = getattr(model, "real_vocab_size", None)
    if not model.post_process or real_vocab is None or fused:
        return out
    local = out.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= real_vocab:
        return out
    padded = torch.arange(start, start + local, device=out.device) >= real_vocab
    return out.masked_fill(padded, -1e9)  # finite: exp() is 0 and 0 * logit stays 0 in the entropy


def logprobs_from_logits(logits: torch.Tensor, mb: Microbatch, with_entropy: bool = True,
                         response_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-target logprobs [sequences, longest - 1] (and entropy) of `mb`, in the padded layout,
    from this rank's vocab-parallel logits: of every position, or (`response_only`, logits from
    `model_forward(..., response_only=True)`) of the response targets, 0 elsewhere."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    if not response_only:
        logprobs, entropy = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], group, vocab_start,
                                                    with_entropy)
        return mb.rows(logprobs), None if entropy is None else mb.rows(entropy)
    logprobs, entropy = vocab_parallel_logprobs(logits, response_tokens(mb)[None], group, vocab_start, with_entropy)
    return per_target(mb, logprobs[0]), None if entropy is None else per_target(mb, entropy[0])


def response_tokens(mb: Microbatch) -> torch.Tensor:
    """The token each of `mb.response_targets` predicts."""
    return mb.input_ids.reshape(-1)[mb.response_targets + 1]


def per_target(mb: Microbatch, values: torch.Tensor) -> torch.Tensor:
    """Values at `mb.response_targets` [targets] -> the padded layout [sequences, longest - 1], 0 elsewhere."""
    b, s = mb.input_ids.shape
    full = values.new_zeros(b * s).index_put((mb.response_targets,), values)
    return mb.rows(full.view(b, s)[:, :-1])


def fused_logprobs(out: torch.Tensor, mb: Microbatch, with_entropy: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What logprobs_from_logits gives, from model_forward's fused output [1, targets, 2]."""
    return per_target(mb, out[0, :, 0]), per_target(mb, out[0, :, 1]) if with_entropy else None


def forward_logprobs(model, mb: Microbatch, with_entropy: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-target logprobs [b, s-1] (and entropy) of `mb`'s response tokens under `model` (no
    pipeline stages); 0 at the prompt's targets and the padding."""
    return logprobs_from_logits(model_forward(model, mb, response_only=True), mb, with_entropy, response_only=True)
