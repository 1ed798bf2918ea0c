"""Routing replay (R3): the trainer's MoE routers take the experts vLLM routed each token to.

An MoE policy's sampler and trainer compute the router's logits with different kernels; where two
experts are nearly tied they pick different ones, and the trainer then scores a token through
experts that never produced it. The importance ratio against vLLM's logprobs swings on such
tokens, and RL on MoE models becomes unstable. With `trainer.routing_replay=rollout` vLLM returns
the experts it chose for every token (`Completion.routed_experts`, stored with the experience),
and every forward of the trainer's step uses them: each router still computes its scores, so its
gradient flows, but the top k are the sampler's (megatron-core's `RouterReplay`, REPLAY_FORWARD).

Layouts. vLLM's routes are one array per sequence, [tokens, layers, k], for every hidden layer
(a dense layer's rows are unused). A Megatron router sees the tokens of its microbatch as
[s, b] flattened position-major (padded microbatches), the packed row in order (packed ones), and,
under sequence parallelism, only its TP rank's contiguous slice of that. `microbatch_routes` lays
a microbatch's routes out in that order once; `replaying` hands each router its layer's slice.
Positions without a route (padding, the filler of a packed row, the last token of a sequence,
which vLLM never ran through the model) take experts 0..k-1: no loss reads what follows them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from rft.trainer.moe import routers


def microbatch_routes(rows: Sequence[np.ndarray], lengths: Sequence[int], width: int, packed: bool,
                      device: torch.device) -> torch.Tensor:
    """[layers, tokens, k] int64 in the order a router sees a microbatch's tokens. `rows`: each
    sequence's routes [tokens, layers, k] (at most its length; missing ones are filled); `width`:
    the padded layout's sequence length, or the packed row's length (fillers included)."""
    layers, k = rows[0].shape[1:]
    count = len(rows)
    filler = np.broadcast_to(np.arange(k), (layers, k))
    if packed:
        out = np.empty((width, layers, k), dtype=np.int64)
        out[:] = filler
        start = 0
        for routes, length in zip(rows, lengths):
            n = min(len(routes), length)
            out[start: start + n] = routes[:n]
            start += length
    else:
        grid = np.empty((count, width, layers, k), dtype=np.int64)
        grid[:] = filler
        for row, (routes, length) in enumerate(zip(rows, lengths)):
            n = min(len(routes), length)
            grid[row, :n] = routes[:n]
        out = grid.transpose(1, 0, 2, 3).reshape(width * count, layers, k)  # [s, b] position-major
    return torch.from_numpy(np.ascontiguousarray(out.transpose(1, 0, 2))).to(device)


@contextlib.contextmanager
def replaying(model, routes: torch.Tensor | None) -> Iterator[None]:
    """While open, every MoE router of `model` (this rank's chunk) routes the microbatch's tokens
    to `routes` [layers, tokens, k] (`microbatch_routes`); None: routers choose, as usual."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    chosen = routers(model) if routes is not None else []
    for router in chosen:
        tokens = routes[router.layer_number - 1]  # global, 1-based
        if router.config.sequence_parallel:  # this TP rank's contiguous slice of the sequence
            tp = parallel_state.get_tensor_model_parallel_world_size()
            share = tokens.shape[0] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            tokens = tokens[rank * share: (rank + 1) * share]
        router.router_replay.set_target_indices(tokens)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router in chosen:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
