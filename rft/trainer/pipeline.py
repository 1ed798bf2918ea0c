"""Forward/backward over microbatches on one pipeline stage, by Megatron's own schedules.

With PP = 1 each microbatch runs forward then backward at once. With PP > 1 the stages run
megatron-core's non-interleaved 1F1B schedule (`get_forward_backward_func`): stage s of P first
runs P - s - 1 forwards (warm-up), then alternates one forward and one backward, then finishes the
backwards left, so it holds the activations of at most P - s microbatches at once. Hidden states
[s, b, h] ([s/TP, b, h] sequence-parallel) and their gradients travel by Megatron's p2p
communicator, shapes first (`variable_seq_lengths`: rft's microbatches differ in length and rows).
With trainer.virtual_pipeline_stages = V > 1 each stage holds V model chunks and Megatron's
interleaved 1F1B schedule runs them. On CPU the schedules run on gloo with two redirects
(rft/trainer/cpu_compat.py), so the tests here run the code GPUs run.

rft's side is the per-microbatch contract: `loss_fn(m, mb, *head(output, mb))` on the last stage,
already normalised by the caller (train_step.py divides by the whole batch's token count), so it
is handed to Megatron as a per-token loss (`calculate_per_token_loss`) that the schedule leaves
as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from rft.trainer.forward import (
    Microbatch,
    fused_logprobs,
    logprobs_from_logits,
    model_forward,
    sequence_multiple,
)
from rft.trainer.moe import aux_loss_scale_kept, set_aux_loss_scale, unscaled_loss

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
    not `with_entropy`), from logits computed at the response targets alone; with `chunk` > 0
    (trainer.logprob_chunk), computed by the output layer itself chunk by chunk of positions
    (rft/trainer/chunked_logprob.py), so no whole logits exist."""

    response_only = True  # (False: logits at every position, as before; tests compare the two)

    def __init__(self, with_entropy: bool = True, chunk: int = 0):
        self.with_entropy, self.chunk = with_entropy, chunk

    def __call__(self, out: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.chunk > 0 and self.response_only:
            return fused_logprobs(out, mb, self.with_entropy)
        return logprobs_from_logits(out, mb, self.with_entropy, response_only=self.response_only)


def policy_head(model, with_entropy: bool = True) -> LogprobsHead:
    """The policy's head with the model's trainer.logprob_chunk (set on its chunks when built)."""
    from rft.trainer.chunks import model_chunks

    return LogprobsHead(with_entropy, getattr(model_chunks(model)[0], "logprob_chunk", 0))


def _run_model(model, mb: Microbatch, head) -> torch.Tensor:
    return model_forward(model, mb, response_only=getattr(head, "response_only", False),
                         fused_chunk=getattr(head, "chunk", 0), with_entropy=getattr(head, "with_entropy", True))


_ONE = torch.ones((), dtype=torch.int)  # the "token count" handed to Megatron with an already normalised loss


def _megatron_schedule(model, mbs: list[Microbatch], head: Head, loss_fn: LossFn | None) -> list:
    """Run Megatron's pipeline schedule over `mbs`: with `loss_fn`, forward and backward (gradients
    accumulate in the parameters); without, forward only. Returns, on the last stage, what each
    microbatch's loss function gave back (forward only: its head's output), in order.

    Under a virtual pipeline the interleaved schedule takes microbatches in groups of P: a count
    that is not a multiple of P (or is below P) is topped up with copies of the smallest
    microbatch, whose loss is 0 and whose output is dropped."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rft.trainer.cpu_compat import cuda_tensors_on_cpu
    from rft.trainer.chunks import model_chunks

    if not mbs:
        return []
    chunks = model_chunks(model)
    real = len(mbs)
    if len(chunks) > 1:
        pp = ps.get_pipeline_model_parallel_world_size()
        smallest = min(mbs, key=lambda mb: mb.input_ids.numel())
        mbs = mbs + [smallest] * (max(pp - real, (-real) % pp))

    def forward_step(data: Iterator[tuple[int, Microbatch]], chunk):
        m, mb = next(data)  # Megatron has already set a later chunk's input (set_input_tensor)
        output = _run_model(chunk, mb, head)

        def finish(out: torch.Tensor, non_loss_data: bool = False):
            if non_loss_data:
                return head(out, mb)
            loss = loss_fn(m, mb, *head(out, mb)) if m < real else out.float().sum() * 0.0  # a filler
            return unscaled_loss(loss, chunk.config), _ONE, None

        return output, finish

    # every chunk reads the microbatches in order (the schedule decides when): one iterator each
    data = [iter(enumerate(mbs)) for _ in chunks]
    with cuda_tensors_on_cpu(), aux_loss_scale_kept(chunks[0].config):
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
            # shapes travel with each message (variable_seq_lengths): these two are not read
            num_microbatches=len(mbs), seq_length=mbs[0].input_ids.shape[1],
            micro_batch_size=mbs[0].input_ids.shape[0],
            forward_only=loss_fn is None, collect_non_loss_data=loss_fn is None)
    return out[:real]


def forward_backward(model, mbs: list[Microbatch], loss_fn: LossFn, with_entropy: bool = True,
                     head: Head | None = None) -> None:
    """Accumulate gradients of sum(loss_fn(m, mb, *head(output, mb))) over `mbs` (loss_fn runs on
    the last stage); the default head gives logprobs and entropy (unless `with_entropy` is False)."""
    from megatron.core import parallel_state as ps

    from rft.trainer.chunks import model_chunks

    head = head or policy_head(model, with_entropy)
    if model_chunks(model)[0].config.num_moe_experts:
        # the tokens this rank's routers see: under sequence parallelism 1/TP of each microbatch
        routed = sum(mb.input_ids.numel() for mb in mbs) // sequence_multiple(model)
        set_aux_loss_scale(routed, ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() == 1:
        for m, mb in enumerate(mbs):
            loss_fn(m, mb, *head(_run_model(model, mb, head), mb)).backward()
        return
    _megatron_schedule(model, mbs, head, loss_fn)


def forward_logprobs_pipelined(model, mbs: list[Microbatch]) -> list[torch.Tensor] | None:
    """Per-target logprobs of each microbatch; returned on the last stage, None elsewhere."""
    out = forward_pipelined(model, mbs, policy_head(model, with_entropy=False))
    return None if out is None else [logprobs for logprobs, _ in out]


@torch.no_grad()
def forward_pipelined(model, mbs: list[Microbatch], head: Callable[[torch.Tensor, Microbatch], torch.Tensor]
                      ) -> list[torch.Tensor] | None:
    """head(output, mb) of each microbatch, without gradients; returned on the last stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return [head(_run_model(model, mb, head), mb) for mb in mbs]
    out = _megatron_schedule(model, mbs, head, None)
    return out if ps.is_pipeline_last_stage() else None
