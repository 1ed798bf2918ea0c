"""One DPO optimizer step on preference pairs (Rafailov et al. 2023), offline (`mode=train`).

Rows come in pairs: row 2i is prompt + chosen, row 2i+1 the same prompt + rejected. Pairs are split
over data-parallel ranks and microbatches whole (a pair's two rows stay together, so the loss sees
both): `micro_batch_size` rows padded, or with `max_tokens_per_microbatch` whole pairs packed up to
that many tokens as the RL and SFT steps pack rows (rft/trainer/microbatches.py). Each row's
response logprobs are summed, the frozen reference model (the policy at stage start) gives the
same sums, and the loss is the mean over all pairs of -log sigmoid(beta * margin).
"""

from __future__ import annotations

import torch

from rft.algorithms.policy_losses import dpo_loss
from rft.config import AlgorithmConfig
from rft.trainer.flops import FORWARD, FORWARD_BACKWARD, parameter_count
from rft.trainer.forward import Microbatch, pack_microbatch, sequence_multiple
from rft.trainer.microbatches import pair_microbatches
from rft.trainer.pipeline import forward_logprobs_pipelined
from rft.trainer.step_batch import StepBatch
from rft.trainer.vision import mrope_of
from rft.trainer.train_step import _dp, backward_and_step, step_scalars


def _sequence_sums(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)).sum(dim=-1)


def dpo_step(model, optimizer, ref_model, batch: StepBatch, algo: AlgorithmConfig, micro_batch_size: int,
             pad_id: int, max_tokens_per_microbatch: int = 0) -> dict[str, float]:
    dp_rank, dp_size, _ = _dp()
    pairs = list(range(dp_rank, len(batch.prompt_ids) // 2, dp_size))
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    chunks = pair_microbatches(pairs, lengths, micro_batch_size, max_tokens_per_microbatch)
    device = next(model.parameters()).device
    packed = max_tokens_per_microbatch > 0
    mbs = [pack_microbatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx], pad_id, device,
                           packed=packed, multiple_of=sequence_multiple(model), mrope=mrope_of(model))
           for idx in chunks]
    num_pairs = float(len(batch.prompt_ids) // 2)
    with torch.no_grad():
        ref = forward_logprobs_pipelined(ref_model, mbs)
    sums = {"loss/dpo": 0.0, "dpo/accuracy": 0.0, "dpo/margin": 0.0, "dpo/chosen_reward": 0.0,
            "dpo/rejected_reward": 0.0}

    def loss_fn(m: int, mb: Microbatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        seq = _sequence_sums(logprobs, mb.loss_mask)
        ref_seq = _sequence_sums(ref[m], mb.loss_mask)
        loss, metrics = dpo_loss(seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], algo.dpo_beta)
        n = loss.numel()
        sums["loss/dpo"] += loss.detach().sum().item()
        for key, name in (("dpo/accuracy", "rewards/accuracy"), ("dpo/margin", "rewards/margin"),
                          ("dpo/chosen_reward", "rewards/chosen"), ("dpo/rejected_reward", "rewards/rejected")):
            sums[key] += float(metrics[name]) * n
        return loss.sum() / num_pairs

    sums, result = backward_and_step(model, optimizer, mbs, loss_fn, sums, algo.grad_clip, with_entropy=False)
    metrics = {k: v / num_pairs for k, v in sums.items()}
    metrics["loss/policy"] = metrics["loss/dpo"]
    metrics.update(step_scalars(result))
    metrics["train/tokens"] = float(sum(len(r) for r in batch.response_ids))
    # this rank's rows through the reference (a forward) and the policy (forward and backward)
    tokens = sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for chunk in chunks for i in chunk)
    metrics["train/model_flops"] = float(parameter_count(model) * (FORWARD + FORWARD_BACKWARD) * tokens)
    return metrics
