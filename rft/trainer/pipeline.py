"""Forward/backward over microbatches on one pipeline stage, in 1F1B order.

With PP = 1 each microbatch runs forward then backward at once. With PP > 1 stage s of P first
runs P - s - 1 forwards (warm-up), then alternates one forward and one backward, then finishes
the backwards left: Megatron's non-interleaved 1F1B. A stage holds the activations of at most
P - s microbatches at once, where a GPipe order (every forward, then every backward) held all of
them; each parameter's gradient still sums its microbatches in the same order. Stages exchange
hidden states [s, b, h] ([s/TP, b, h] sequence-parallel) and their gradients point to point on the trainer group, a send and the
receive it waits on posted together (batch_isend_irecv) so that neighbours never both wait.

Megatron's own schedules allocate CUDA tensors unconditionally (see rft/trainer/cpu_compat.py), so
this loop is what runs on CPU and GPU alike; every stage packs the same microbatches, so the
shape of what arrives is known without exchanging it.
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


def _run_model(model, mb: Microbatch, hidden_in: torch.Tensor | None, head) -> torch.Tensor:
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
    return model_forward(model, mb, response_only=getattr(head, "response_only", False))


def _exchange(sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
    """Post every send and receive at once and wait for all (a peer may be sending to us while
    we send to it)."""
    ops = [dist.P2POp(dist.isend, tensor.detach().contiguous(), peer) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, buffer, peer) for buffer, peer in receives]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Stage:
    """One pipeline stage's side of the exchanges: hidden states come from the previous stage and
    go to the next; their gradients travel back. The first stage receives no input and sends no
    input gradient; the last sends no output and receives no output gradient (its loss is the end)."""

    def __init__(self, model):
        from megatron.core import parallel_state as ps

        self.model = model
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.prev, self.next = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
        self.device = next(model.parameters()).device

    def input_buffer(self, mb: Microbatch) -> torch.Tensor:
        config = self.model.config  # sequence-parallel stages exchange their TP rank's slice
        length = mb.input_ids.shape[1] // (config.tensor_model_parallel_size if config.sequence_parallel else 1)
        shape = (length, mb.input_ids.shape[0], config.hidden_size)
        return torch.empty(shape, dtype=config.pipeline_dtype, device=self.device)

    def exchange(self, send_output: torch.Tensor | None = None, receive_input_for: Microbatch | None = None,
                 send_input_grad: torch.Tensor | None = None, receive_grad_of: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send this stage's output forward and/or its input's gradient back while receiving the
        next input and/or the output's gradient; returns (input, output gradient) as received."""
        sends, receives = [], []
        hidden_in = grad_out = None
        if send_output is not None and not self.last:
            sends.append((send_output, self.next))
        if send_input_grad is not None and not self.first:
            sends.append((send_input_grad, self.prev))
        if receive_input_for is not None and not self.first:
            hidden_in = self.input_buffer(receive_input_for)
            receives.append((hidden_in, self.prev))
        if receive_grad_of is not None and not self.last:
            grad_out = torch.empty_like(receive_grad_of)
            receives.append((grad_out, self.next))
        _exchange(sends, receives)
        if hidden_in is not None:
            hidden_in.requires_grad_(True)
        return hidden_in, grad_out


def forward_backward(model, mbs: list[Microbatch], loss_fn: LossFn, with_entropy: bool = True,
                     head: Head | None = None) -> None:
    """Accumulate gradients of sum(loss_fn(m, mb, *head(output, mb))) over `mbs` (loss_fn runs on
    the last stage); the default head gives logprobs and entropy (unless `with_entropy` is False)."""
    from megatron.core import parallel_state as ps

    head = head or LogprobsHead(with_entropy)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        for m, mb in enumerate(mbs):
            loss_fn(m, mb, *head(_run_model(model, mb, None, head), mb)).backward()
        return
    stage = _Stage(model)
    in_flight: list[tuple[torch.Tensor | None, torch.Tensor]] = []  # (input, output or loss) awaiting backward

    def forward(m: int, hidden_in: torch.Tensor | None) -> torch.Tensor:
        out = _run_model(model, mbs[m], hidden_in, head)
        if stage.last:
            out = loss_fn(m, mbs[m], *head(out, mbs[m]))
        in_flight.append((hidden_in, out))
        return out

    def backward(grad_out: torch.Tensor | None) -> torch.Tensor | None:
        hidden_in, out = in_flight.pop(0)
        out.backward(grad_out)  # the last stage's out is the loss: grad_out is None
        return None if hidden_in is None else hidden_in.grad

    warmup = min(pp - ps.get_pipeline_model_parallel_rank() - 1, len(mbs))
    for m in range(warmup):
        hidden_in, _ = stage.exchange(receive_input_for=mbs[m])
        out = forward(m, hidden_in)
        stage.exchange(send_output=out)
    hidden_in = stage.exchange(receive_input_for=mbs[warmup])[0] if warmup < len(mbs) else None
    for m in range(warmup, len(mbs)):  # steady state: one forward, one backward
        out = forward(m, hidden_in)
        _, grad_out = stage.exchange(send_output=out, receive_grad_of=in_flight[0][1])
        input_grad = backward(grad_out)
        following = mbs[m + 1] if m + 1 < len(mbs) else None
        hidden_in, _ = stage.exchange(send_input_grad=input_grad, receive_input_for=following)
    for _ in range(warmup):  # cool-down: the backwards left
        _, grad_out = stage.exchange(receive_grad_of=in_flight[0][1])
        stage.exchange(send_input_grad=backward(grad_out))


def forward_logprobs_pipelined(model, mbs: list[Microbatch]) -> list[torch.Tensor] | None:
    """Per-target logprobs of each microbatch; returned on the last stage, None elsewhere."""
    out = forward_pipelined(model, mbs, LogprobsHead(with_entropy=False))
    return None if out is None else [logprobs for logprobs, _ in out]


@torch.no_grad()
def forward_pipelined(model, mbs: list[Microbatch], head: Callable[[torch.Tensor, Microbatch], torch.Tensor]
                      ) -> list[torch.Tensor] | None:
    """head(output, mb) of each microbatch, without gradients; returned on the last stage, None elsewhere."""
    stage = _Stage(model)
    out: list[torch.Tensor] = []
    for mb in mbs:
        hidden_in, _ = stage.exchange(receive_input_for=mb)
        result = _run_model(model, mb, hidden_in, head)
        if stage.last:
            out.append(head(result, mb))
        else:
            stage.exchange(send_output=result)
    return out if stage.last else None
