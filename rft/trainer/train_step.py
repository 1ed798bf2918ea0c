"""One optimizer step: a policy-gradient loss on a batch of experience, or SFT on reference answers.

Both share the same shape: split the rows over data-parallel ranks, run microbatches (through the
pipeline stages, rft/trainer/pipeline.py), let the loss aggregation turn each microbatch's
per-token losses into its share of the batch loss (counts over the whole batch, so every DP and
microbatch layout gives the same loss), all-reduce gradients, clip, step. What the loss is comes
from the algorithm registries (rft/algorithms/): advantage estimator (over the whole batch, before
the split), policy loss, KL to a frozen reference (loss term or reward penalty), entropy bonus,
aggregation, and truncated importance sampling against vLLM's logprobs. With a critic
(`advantage=gae`, rft/trainer/critic.py) its values feed the advantages and it takes its own step
towards the returns after the policy's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutputs
from rft.algorithms.aggregation import AGGREGATIONS, masked_token_mean
from rft.algorithms.kl import KL_ESTIMATORS, kl_penalty_rewards
from rft.algorithms.policy_losses import POLICY_LOSSES, truncated_is_weights
from rft.config import AlgorithmConfig
from rft.trainer.forward import Microbatch, pack_microbatch
from rft.trainer.pipeline import forward_backward, forward_logprobs_pipelined
from rft.weights.hf_megatron import tp_split_dim


@dataclass
class StepBatch:
    """Rows this step trains on: a prompt and a response per row.

    SFT and DPO rows are (prompt, reference answer): every response token is trained. RL rows come
    from experience records (rft/buffer/experience.py): the response is everything after the
    first prompt, and `response_mask` marks the tokens the policy sampled (tool output and
    environment messages in between are 0). `rewards`, `old_logprobs` (vLLM's, per response token)
    and `group_ids` (0..G-1, any order, ragged) are None for SFT. `trajectory_ids` (0..N-1) tie
    together rows of one trajectory (the step_wise workflow writes one row per step): per-response
    advantage estimators score each trajectory once and credit every one of its rows.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: list[list[int]] | None = None
    rewards: list[float] | None = None
    old_logprobs: list[list[float]] | None = None
    group_ids: list[int] | None = None
    trajectory_ids: list[int] | None = None

    @classmethod
    def from_experiences(cls, experiences: list) -> "StepBatch":
        """An RL batch from experience records (rft.buffer.experience.Experience)."""
        from rft.algorithms.advantages import group_index

        cut = [e.prompt_length for e in experiences]
        return cls(prompt_ids=[e.token_ids[:p] for e, p in zip(experiences, cut)],
                   response_ids=[e.token_ids[p:] for e, p in zip(experiences, cut)],
                   response_mask=[e.loss_mask[p:] for e, p in zip(experiences, cut)],
                   rewards=[float(e.reward) for e in experiences],
                   old_logprobs=[e.logprobs[p:] for e, p in zip(experiences, cut)],
                   group_ids=group_index([e.group_id for e in experiences]).tolist(),
                   trajectory_ids=group_index([e.trajectory_id or i for i, e in enumerate(experiences)]).tolist())

    def mask_of(self, i: int) -> list[int]:
        """Row i's response mask (all ones for reference answers)."""
        return self.response_mask[i] if self.response_mask is not None else [1] * len(self.response_ids[i])


def _dp():
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group())


def _pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def grad_norm_and_clip(model, max_norm: float) -> float:
    """Global grad L2 norm over TP shards and PP stages (replicated params counted once); clips in place."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    # under PP a tied output layer on the last stage mirrors the embedding: count that one once
    mirror = pp > 1 and model.share_embeddings_and_output_weights and not model.pre_process
    total = torch.zeros(1)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if mirror and name == "output_layer.weight":
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        total += sq if (tp_split_dim(name) is not None or tp == 1) else sq / tp
    if tp > 1:
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    if pp > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _place(batch: StepBatch, idx: list[int], per_response: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Response-aligned values [B, T_resp] (row i = batch row i) at the response targets of a
    microbatch of rows `idx` (packed prompt + response, targets shifted by one)."""
    width = like.shape[1]
    out = torch.zeros_like(like)
    for row, i in enumerate(idx):
        p, n = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        out[row, p - 1: p - 1 + n] = per_response[i, : min(n, width - p + 1)].to(like)
    return out


def _response_part(batch: StepBatch, idx: list[int], packed: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse of `_place`: copy a microbatch's response-target values into rows of `out`."""
    for row, i in enumerate(idx):
        p, n = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        out[i, :n] = packed[row, p - 1: p - 1 + n]


def _response_tensors(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, vLLM logprobs), both [B, longest response], response-aligned; the mask is 1 on the
    response tokens to train."""
    width = max((len(r) for r in batch.response_ids), default=0)
    return _pad_rows([batch.mask_of(i) for i in range(len(batch.response_ids))], width), \
        _pad_rows(batch.old_logprobs, width)


def batch_advantages(batch: StepBatch, algo: AlgorithmConfig, ref_response_logprobs: torch.Tensor | None,
                     values: torch.Tensor | None = None) -> AdvantageOutputs:
    """Token advantages [B, T_resp] over the whole batch (batch-normalising estimators such as
    REINFORCE++ need every row), and returns where the estimator gives them; with `kl_mode=reward`
    the KL to the reference is a per-token reward penalty, measured on vLLM's (behaviour)
    logprobs. `values`: the critic's response-aligned values (gae).

    Rows of one trajectory (step_wise) and a per-response estimator (grpo, rloo, ...): the
    estimator sees each trajectory once, with its group, so a trajectory of many steps weighs
    the same in its group's baseline as one of few; each row gets its trajectory's advantage."""
    mask, old = _response_tensors(batch)
    estimator = ADVANTAGES.resolve(algo.advantage)
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    group_ids = torch.tensor(batch.group_ids, dtype=torch.int64)
    trajectories = torch.tensor(batch.trajectory_ids if batch.trajectory_ids is not None
                                else range(len(batch.rewards)), dtype=torch.int64)
    if ADVANTAGES.meta(estimator).get("per_response") and trajectories.unique().numel() < len(batch.rewards):
        first = torch.full((int(trajectories.max()) + 1,), len(batch.rewards), dtype=torch.int64)
        first = first.scatter_reduce(0, trajectories, torch.arange(len(batch.rewards)), "amin")
        once = estimator(AdvantageInputs(rewards=rewards[first], group_ids=group_ids[first],
                                         mask=torch.ones(len(first), 1)), algo)
        return AdvantageOutputs(advantages=once.advantages[trajectories, :1].expand(mask.shape) * mask)
    token_rewards = None
    if ref_response_logprobs is not None:
        token_rewards = kl_penalty_rewards(old, ref_response_logprobs, mask, algo.kl_estimator, algo.kl_coef)
    inputs = AdvantageInputs(rewards=rewards, group_ids=group_ids, mask=mask, values=values,
                             token_rewards=token_rewards)
    return estimator(inputs, algo)


def _sync_grads(model) -> None:
    """Sum gradients over DP replicas, over the two copies of a tied embedding under PP, and
    over TP for q/k norms (replicated weights, but each TP rank normalises only its own heads)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        for name, p in model.named_parameters():
            if p.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    dp_rank, dp_size, dp_group = _dp()
    if dp_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1 and model.share_embeddings_and_output_weights \
            and ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def backward_and_step(model, optimizer, mbs: list[Microbatch], loss_fn, sums: dict[str, float], grad_clip: float,
                      with_entropy: bool = True, head=None) -> tuple[dict[str, float], float]:
    """Forward/backward every microbatch (`loss_fn` adds its statistics to `sums`), sum gradients
    and statistics over DP (statistics also over PP: only the last stage computes losses), clip,
    step. `head` turns the model's output into loss_fn's inputs (pipeline.forward_backward;
    default: logprobs and entropy). Returns (the summed statistics, the grad norm before clipping)."""
    from megatron.core import parallel_state as ps

    _, dp_size, dp_group = _dp()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    forward_backward(model, mbs, loss_fn, with_entropy, head)
    _sync_grads(model)
    stats = torch.tensor(list(sums.values()))
    if dp_size > 1:
        dist.all_reduce(stats, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(stats, group=ps.get_pipeline_model_parallel_group())
    grad_norm = grad_norm_and_clip(model, grad_clip)
    optimizer.step()
    return dict(zip(sums, stats.tolist())), grad_norm


def _global_counts(batch: StepBatch, rows: list[int], dp_group, dp_size: int) -> tuple[float, float]:
    """Response tokens to train and responses with at least one of them, in the whole batch
    (summed over DP ranks)."""
    counts = torch.tensor([float(sum(sum(batch.mask_of(i)) for i in rows)),
                           float(sum(1 for i in rows if any(batch.mask_of(i))))])
    if dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
    return float(counts[0].clamp(min=1)), float(counts[1].clamp(min=1))


def train_step(model, optimizer, batch: StepBatch, algo: AlgorithmConfig, micro_batch_size: int,
               pad_id: int, ref_model=None, norm_len: int = 1, critic=None) -> dict[str, float]:
    """Forward/backward over microbatches (pipelined when PP > 1), then one optimizer step.
    `norm_len` is the constant of the seq-mean-token-sum-norm aggregation (max response length).
    `critic` (rft.trainer.critic.Critic, RL batches only): its values before the update feed the
    advantage estimator, its returns are the critic's targets, and it steps after the policy."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, dp_group = _dp()
    rows = list(range(dp_rank, len(batch.prompt_ids), dp_size))
    device = next(model.parameters()).device
    num_tokens, num_seqs = _global_counts(batch, rows, dp_group, dp_size)
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "actor/entropy": 0.0, "actor/clipfrac": 0.0, "actor/is_weight": 0.0}
    is_rl = batch.rewards is not None
    chunks = [rows[s: s + micro_batch_size] for s in range(0, len(rows), micro_batch_size)]

    def pack(idx_chunks):
        return [pack_microbatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                                pad_id, device, [batch.mask_of(i) for i in idx]) for idx in idx_chunks]

    mbs = pack(chunks)
    policy_loss = POLICY_LOSSES.resolve(algo.policy_loss if is_rl else "sft")  # no rewards: reference answers
    aggregate = AGGREGATIONS.resolve(algo.loss_agg)
    use_ref = is_rl and ref_model is not None and algo.kl_coef > 0
    kl_in_loss = use_ref and algo.kl_mode == "loss"
    ref_logprobs = forward_logprobs_pipelined(ref_model, mbs) if kl_in_loss else None
    ref_all = all_chunks = None
    if use_ref and algo.kl_mode == "reward":
        # the penalty enters batch-wide advantages: every row's reference logprobs are needed
        # (a pipelined forward: every stage takes part, the last one gets the logprobs)
        all_rows = list(range(len(batch.prompt_ids)))
        all_chunks = [all_rows[s: s + micro_batch_size] for s in range(0, len(all_rows), micro_batch_size)]
        ref_all = forward_logprobs_pipelined(ref_model, pack(all_chunks))
    # V_old of every row (a pipelined collective; on the last stage): GAE's input, the value clip's anchor
    old_values = critic.values(batch, chunks, mbs) if is_rl and critic is not None else None
    advantages = returns = rollout_old = trainer_old = None
    if is_rl and ps.is_pipeline_last_stage():
        ref_response = None
        if ref_all is not None:
            ref_response = torch.zeros(len(batch.prompt_ids), max(len(r) for r in batch.response_ids))
            for idx, lp in zip(all_chunks, ref_all):
                _response_part(batch, idx, lp.float().cpu(), ref_response)
        estimated = batch_advantages(batch, algo, ref_response, old_values)
        advantages, returns = estimated.advantages, estimated.returns
        rollout_old = _response_tensors(batch)[1]
    if is_rl and algo.tis_cap is not None:
        with torch.no_grad():  # the trainer's own logprobs before the update: the PPO ratio's base
            trainer_old = forward_logprobs_pipelined(model, mbs)

    def loss_fn(m: int, mb: Microbatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        mask = mb.loss_mask
        tokens = mask.sum().item()
        view = SimpleNamespace(**asdict(algo))
        if is_rl:
            old = _place(batch, chunks[m], rollout_old, logprobs)
            adv = _place(batch, chunks[m], advantages, logprobs)
            if trainer_old is not None:
                view.is_weights = truncated_is_weights(trainer_old[m], old, algo.tis_cap, mask)
                sums["actor/is_weight"] += masked_token_mean(view.is_weights, mask).item() * tokens
                old = trainer_old[m]
        else:
            old = adv = torch.zeros_like(logprobs)
        per_token, metrics = policy_loss(logprobs, old, adv, mask, view)
        sums["loss/policy"] += masked_token_mean(per_token, mask).item() * tokens
        if "clipfrac" in metrics:
            sums["actor/clipfrac"] += float(metrics["clipfrac"]) * tokens
        if kl_in_loss:
            kl = KL_ESTIMATORS.resolve(algo.kl_estimator)(logprobs, ref_logprobs[m])
            per_token = per_token + algo.kl_coef * kl
            sums["loss/kl"] += masked_token_mean(kl, mask).item() * tokens
        if entropy is not None:
            sums["actor/entropy"] += masked_token_mean(entropy, mask).item() * tokens
            if algo.entropy_coef:
                per_token = per_token - algo.entropy_coef * entropy
        return aggregate(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)

    sums, grad_norm = backward_and_step(model, optimizer, mbs, loss_fn, sums, algo.grad_clip)
    metrics = {k: v / num_tokens for k, v in sums.items()}
    if algo.tis_cap is None or not is_rl:  # (trainer_old is None on all but the last PP stage)
        del metrics["actor/is_weight"]
    metrics["actor/grad_norm"] = grad_norm
    metrics["train/tokens"] = num_tokens
    if not is_rl:
        metrics["loss/sft"] = metrics["loss/policy"]
    if is_rl and critic is not None:
        metrics.update(critic.update(batch, chunks, mbs, old_values, returns, algo, num_tokens, num_seqs, norm_len))
    return metrics
