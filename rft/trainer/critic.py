"""PPO's critic: a value model trained beside the policy (`algorithm.advantage=gae`).

The critic is a second Megatron GPTModel, this rank's TP x PP shard like the policy, whose output
layer is a value head (hidden -> 1) instead of the vocabulary projection, so GPTModel.forward
returns one value per position and the pipeline schedule (rft/trainer/pipeline.py) runs it unchanged.
It is built untied (its output layer is its own, the PP embedding group never touches it) and its
trunk starts as a copy of the policy at the stage start: the HF weights in a first stage, the
SFT'd weights after a warm-up (verl starts its critic from the checkpoint the actor starts from).

Per step (rft/trainer/train_step.py): `values` scores the batch before any update (V_old, which
GAE turns into advantages and returns), the policy steps, then `update` takes one AdamW step
(`algorithm.critic_lr`, `algorithm.grad_clip`) on PPO's clipped value loss towards the returns
(rft/algorithms/value_loss.py), aggregated with `algorithm.loss_agg` like the policy loss.

Alignment: V(s_t) for response token t is the value at the position that predicts t, the same
position whose logit scores t (verl: values[:, -response_length - 1:-1]); so values live on the
loss mask's positions and `place_in_microbatch` / `take_from_microbatch` map them like logprobs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rft.algorithms.aggregation import AGGREGATIONS, masked_token_mean
from rft.algorithms.value_loss import clipped_value_loss
from rft.config import AlgorithmConfig
from rft.trainer.forward import Microbatch, gather_sequence
from rft.trainer.devices import collective_device
from rft.trainer.optimizer import build_optimizer
from rft.trainer.pipeline import forward_pipelined
from rft.trainer.step_batch import StepBatch, place_in_microbatch, take_from_microbatch
from rft.trainer.train_step import _dp, backward_and_step, step_scalars


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1]; replicated on every TP rank.

    Stands in for GPTModel's output layer, so it returns (output, bias) and accepts the keywords
    GPTModel passes. The decoder's output is complete on every TP rank (under sequence parallelism
    once gathered), so each rank computes the same values and the gradient into the trunk needs
    no TP reduction, as the policy's vocab-parallel loss (rft/trainer/forward.py). Parameter names end in
    `head.weight`/`head.bias`, which `tp_split_dim` treats as replicated (grad norm counts them once).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, seed: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        # the same weights on every rank without a broadcast: a private generator, not the global RNG
        # (whose state differs between stages); std 1/(h+1) as OpenRLHF's value head, bias 0
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = torch.randn(1, hidden_size, generator=gen) / (hidden_size + 1)
            self.head.weight.copy_(weight.to(dtype))
            self.head.bias.zero_()

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
                ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = gather_sequence(hidden)
        return self.head(hidden), None


def values_of(output: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """[sequences, longest - 1] float values on the loss mask's positions from the critic's
    output [b, s, 1] (padded layout, packed or not)."""
    return mb.rows(output[:, :-1, 0].float())


def build_critic_model(hf_path: str, dtype: str, policy, seed: int):
    """This rank's critic shard: the policy's trunk (copied) under a fresh value head."""
    from rft.trainer.chunks import model_chunks
    from rft.trainer.model import build_gpt_model

    granularity = policy.config.recompute_granularity  # None, "selective" or "full": the critic recomputes alike
    model, _ = build_gpt_model(hf_path, dtype, tie_embeddings=False, recompute=granularity or "none",
                               sequence_parallel=policy.config.sequence_parallel,
                               transformer_impl=policy.config.transformer_impl)
    for chunk in model_chunks(model):  # the last chunk of the last stage holds the output layer
        chunk.real_vocab_size = None  # no vocabulary columns to mask (forward.model_forward)
        if chunk.post_process:
            param = next(chunk.parameters())
            chunk.output_layer = ValueHead(chunk.config.hidden_size, param.dtype, param.device, seed,
                                           chunk.config.sequence_parallel)
    # the policy's own output layer (tied or not) is what the value head replaces
    trunk = {k: v for k, v in policy.state_dict().items() if not _in_output_layer(k)}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and all(_in_output_layer(k) for k in missing), (missing, unexpected)
    return model


def _in_output_layer(key: str) -> bool:
    return key.startswith("output_layer.") or ".output_layer." in key  # (chunks.<v>.output_layer.)


class Critic:
    """The value model and its optimizer: scores batches, steps on the value loss, checkpoints."""

    def __init__(self, model, algo: AlgorithmConfig, loss_scale: float | None = None, distributed: bool = False):
        self.model = model
        # constant LR (no warm-up): the critic has to track returns from the first step
        self.optimizer = build_optimizer(model, lr=algo.critic_lr, weight_decay=algo.weight_decay,
                                         loss_scale=loss_scale, distributed=distributed)

    @classmethod
    def build(cls, hf_path: str, dtype: str, policy, algo: AlgorithmConfig, seed: int,
              loss_scale: float | None = None, distributed: bool = False) -> "Critic":
        return cls(build_critic_model(hf_path, dtype, policy, seed), algo, loss_scale, distributed)

    def values(self, batch: StepBatch, chunks: list[list[int]], mbs: list[Microbatch]) -> torch.Tensor | None:
        """Response-aligned values [B, T_resp] of EVERY row of the batch (GAE whitens batch-wide),
        0 on padding; on the last pipeline stage, None elsewhere.

        Each DP rank scores its own rows (`chunks`, packed as `mbs`) and a sum over DP fills in the
        rest: every row is written by exactly one DP rank. A pipelined collective: every stage calls it.
        """
        self.model.eval()
        out = forward_pipelined(self.model, mbs, values_of)
        if out is None:
            return None
        width = max((len(r) for r in batch.response_ids), default=0)
        full = torch.zeros(len(batch.response_ids), width)
        for idx, packed in zip(chunks, out):
            take_from_microbatch(batch, idx, packed.cpu(), full)
        _, dp_size, dp_group = _dp()
        if dp_size > 1:
            on_wire = full.to(collective_device())
            dist.all_reduce(on_wire, group=dp_group)
            full = on_wire.cpu()
        return full

    def update(self, batch: StepBatch, chunks: list[list[int]], mbs: list[Microbatch], old_values: torch.Tensor | None,
               returns: torch.Tensor | None, algo: AlgorithmConfig, num_tokens: float, num_seqs: float,
               norm_len: int) -> dict[str, float]:
        """One optimizer step on the clipped value loss over this DP rank's rows. `old_values` and
        `returns` are response-aligned [B, T_resp] (None except on the last stage); `num_tokens`,
        `num_seqs` and `norm_len` are the whole batch's, as for the policy loss."""
        aggregate = AGGREGATIONS.resolve(algo.loss_agg)
        sums = {"critic/value_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/values_mean": 0.0,
                "critic/returns_mean": 0.0}

        def loss_fn(m: int, mb: Microbatch, values: torch.Tensor) -> torch.Tensor:
            mask = mb.loss_mask
            old = place_in_microbatch(batch, chunks[m], old_values, values)
            target = place_in_microbatch(batch, chunks[m], returns, values)
            per_token, metrics = clipped_value_loss(values, old, target, mask, algo.value_clip)
            tokens = mask.sum().item()
            sums["critic/value_loss"] += masked_token_mean(per_token, mask).item() * tokens
            sums["critic/vf_clipfrac"] += float(metrics["vf_clipfrac"]) * tokens
            sums["critic/values_mean"] += masked_token_mean(values.detach(), mask).item() * tokens
            sums["critic/returns_mean"] += masked_token_mean(target, mask).item() * tokens
            return aggregate(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)

        sums, result = backward_and_step(self.model, self.optimizer, mbs, loss_fn, sums, algo.grad_clip,
                                            head=lambda out, mb: (values_of(out, mb),))
        metrics = {k: v / num_tokens for k, v in sums.items()}
        metrics.update(step_scalars(result, "critic"))
        return metrics

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
