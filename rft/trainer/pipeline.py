"""Forward/backward over microbatches on one pipeline stage (GPipe order).

With PP = 1 each microbatch runs forward then backward at once. With PP > 1 every microbatch
goes forward through the stages first, then every backward in the same order; stages exchange
hidden states [s, b, h] and their gradients point to point on the trainer group. Megatron's own
schedules allocate CUDA tensors unconditionally (see rft/trainer/cpu_compat.py), so this plain
schedule is what runs on CPU and GPU alike; every stage packs the same microbatches, so the shape
of what arrives is known without exchanging it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rft.trainer.forward import Microbatch, logprobs_from_logits, model_forward

# (microbatch index, microbatch, *head outputs) -> scalar loss to backward; with the default head
# the outputs are (logprobs [b, s-1], entropy or None)
LossFn = Callable[..., torch.Tensor]
# the last stage's model output and its microbatch -> what the loss (or the caller) takes: the
# policy's head turns logits into logprobs, the critic's (rft/trainer/critic.py) reads values.
# A head with `response_only = True` gets the model's output at the response targets alone
# (forward.model_forward).
Head = Callable[[torch.Tensor, Microbatch], tuple]


class LogprobsHead:
    """The policy's head: per-target logprobs of the response tokens and their entropy (unless
    not `with_entropy`), from logits computed at the response targets alone."""

    response_only = True  # (False: logits at every position, as before; tests compare the two)

    def __init__(self, with_entropy: bool = True):
        self.with_entropy = with_entropy

    def __call__(self, logits: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return logprobs_from_logits(logits, mb, self.with_entropy, response_only=self.response_only)


def _stage():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size(), ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()


def _run_model(model, mb: Microbatch, hidden_in: torch.Tensor | None, head) -> torch.Tensor:
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
    return model_forward(model, mb, response_only=getattr(head, "response_only", False))


def _hidden_shape(model, mb: Microbatch) -> tuple[int, int, int]:
    return mb.input_ids.shape[1], mb.input_ids.shape[0], model.config.hidden_size


def _recv(shape, dtype, device, peer: int) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.irecv(buf, src=peer).wait()
    return buf


def _send(tensor: torch.Tensor, peer: int) -> None:
    dist.isend(tensor.detach().contiguous(), dst=peer).wait()


def forward_backward(model, mbs: list[Microbatch], loss_fn: LossFn, with_entropy: bool = True,
                     head: Head | None = None) -> None:
    """Accumulate gradients of sum(loss_fn(m, mb, *head(output, mb))) over `mbs` (loss_fn runs on
    the last stage); the default head gives logprobs and entropy (unless `with_entropy` is False)."""
    from megatron.core import parallel_state as ps

    head = head or LogprobsHead(with_entropy)
    pp, first, last = _stage()
    if pp == 1:
        for m, mb in enumerate(mbs):
            loss_fn(m, mb, *head(_run_model(model, mb, None, head), mb)).backward()
        return
    param = next(model.parameters())
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    kept: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    for m, mb in enumerate(mbs):
        hidden_in = None
        if not first:
            hidden_in = _recv(_hidden_shape(model, mb), model.config.pipeline_dtype, param.device, prev)
            hidden_in.requires_grad_(True)
        out = _run_model(model, mb, hidden_in, head)
        if last:
            out = loss_fn(m, mb, *head(out, mb))
        else:
            _send(out, nxt)
        kept.append((hidden_in, out))
    for hidden_in, out in kept:
        if last:
            out.backward()
        else:
            out.backward(_recv(out.shape, out.dtype, out.device, nxt))
        if not first:
            _send(hidden_in.grad, prev)


def forward_logprobs_pipelined(model, mbs: list[Microbatch]) -> list[torch.Tensor] | None:
    """Per-target logprobs of each microbatch; returned on the last stage, None elsewhere."""
    out = forward_pipelined(model, mbs, LogprobsHead(with_entropy=False))
    return None if out is None else [logprobs for logprobs, _ in out]


@torch.no_grad()
def forward_pipelined(model, mbs: list[Microbatch], head: Callable[[torch.Tensor, Microbatch], torch.Tensor]
                      ) -> list[torch.Tensor] | None:
    """head(output, mb) of each microbatch, without gradients; returned on the last stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    _, first, last = _stage()
    param = next(model.parameters())
    out: list[torch.Tensor] = []
    for mb in mbs:
        hidden_in = None
        if not first:
            hidden_in = _recv(_hidden_shape(model, mb), model.config.pipeline_dtype, param.device,
                              ps.get_pipeline_model_parallel_prev_rank())
        result = _run_model(model, mb, hidden_in, head)
        if last:
            out.append(head(result, mb))
        else:
            _send(result, ps.get_pipeline_model_parallel_next_rank())
    return out if last else None
