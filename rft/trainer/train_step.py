"""A trainer step: a policy-gradient loss on a batch of experience, or SFT on reference answers.

    fixed = advantages, old logprobs, reference logprobs, V_old   # once, before any update
    for epoch in range(algorithm.ppo_epochs):
        for mini_batch in batch, algorithm.mini_batch_size rows at a time:
            one optimizer step on it                              # then the critic's, if any

An optimizer step splits its rows over data-parallel ranks, runs microbatches (through the
pipeline stages, rft/trainer/pipeline.py), lets the loss aggregation turn each microbatch's
per-token losses into its share of the mini-batch loss (counts over the whole mini-batch, so every
DP and microbatch layout gives the same loss), and leaves gradient sums, clipping and the update to
the optimizer (rft/trainer/optimizer.py). What the loss is comes from the algorithm registries
(rft/algorithms/): advantage estimator (over the whole batch, before the split), policy loss, KL to
a frozen reference (loss term or reward penalty), entropy bonus, aggregation, and truncated
importance sampling against vLLM's logprobs. With a critic (`advantage=gae`, rft/trainer/critic.py)
its values feed the advantages and it takes its own step towards the returns after each of the
policy's.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rft.algorithms.advantages import ADVANTAGES, AdvantageOutputs
from rft.algorithms.aggregation import AGGREGATIONS, masked_token_mean, zero_padding
from rft.algorithms.chord import expert_token_loss
from rft.algorithms.kl import KL_ESTIMATORS
from rft.algorithms.policy_losses import POLICY_LOSSES, truncated_is_weights
from rft.config import AlgorithmConfig
from rft.trainer.flops import FORWARD, FORWARD_BACKWARD, parameter_count
from rft.trainer.forward import Microbatch, pack_microbatch, sequence_multiple
from rft.trainer.microbatches import microbatches, mini_batch_rows, mini_batches
from rft.trainer.devices import collective_device
from rft.trainer.optimizer_contract import StepResult, TrainerOptimizer
from rft.trainer.pipeline import forward_backward, forward_logprobs_pipelined
from rft.trainer.step_batch import (
    StepBatch,
    batch_advantages,
    place_in_microbatch,
    response_tensors,
    take_from_microbatch,
    teacher_scalars,
)
from rft.trainer.vision import image_inputs, mrope_of


def _dp():
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group())


def backward_and_step(model, optimizer: TrainerOptimizer, mbs: list[Microbatch], loss_fn, sums: dict[str, float],
                      grad_clip: float, with_entropy: bool = True, head=None) -> tuple[dict[str, float], StepResult]:
    """Forward/backward every microbatch (`loss_fn` adds its statistics to `sums`; its loss is
    scaled by the optimizer's loss scale), sum statistics over DP (and over PP: only the last
    stage computes losses), then the optimizer's step (rft/trainer/optimizer.py: gradient sums,
    clipping, fp32 masters). `head` turns the model's output into loss_fn's inputs
    (pipeline.forward_backward; default: logprobs and entropy). Returns the summed statistics and
    how the step went."""
    from megatron.core import parallel_state as ps

    _, dp_size, dp_group = _dp()
    model.train()
    optimizer.zero_grad()
    forward_backward(model, mbs, lambda *args: optimizer.scale_loss(loss_fn(*args)), with_entropy, head)
    stats = torch.tensor(list(sums.values()), device=collective_device())
    if dp_size > 1:
        dist.all_reduce(stats, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(stats, group=ps.get_pipeline_model_parallel_group())
    return dict(zip(sums, stats.tolist())), optimizer.step(grad_clip)


def step_scalars(result: StepResult, prefix: str = "actor") -> dict[str, float]:
    """What to log of an optimizer step: the grad norm, a skipped step, a loss scale other than 1."""
    scalars = {f"{prefix}/grad_norm": result.grad_norm, f"{prefix}/step_skipped": float(not result.stepped)}
    if result.loss_scale != 1.0:
        scalars[f"{prefix}/loss_scale"] = result.loss_scale
    return scalars


def _global_counts(batch: StepBatch, rows: list[int], dp_group, dp_size: int,
                   at_least_one: bool = True) -> tuple[float, float]:
    """Response tokens to train and responses with at least one of them, in the whole batch
    (summed over DP ranks); at least 1 each (they divide), unless `at_least_one` is False."""
    counts = torch.tensor([float(sum(sum(batch.mask_of(i)) for i in rows)),
                           float(sum(1 for i in rows if any(batch.mask_of(i))))], device=collective_device())
    if dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
    if at_least_one:
        counts = counts.clamp(min=1)
    return float(counts[0]), float(counts[1])


def train_step(model, optimizer: TrainerOptimizer, batch: StepBatch, algo: AlgorithmConfig, micro_batch_size: int,
               pad_id: int, ref_model=None, norm_len: int = 1, critic=None,
               per_optimizer_step: list[dict[str, float]] | None = None,
               max_tokens_per_microbatch: int = 0, skip_zero_advantage: bool = False) -> dict[str, float]:
    """`algorithm.ppo_epochs` passes over the batch, each in mini-batches of
    `algorithm.mini_batch_size` rows, one optimizer step per mini-batch (one step for the whole
    batch by default). Everything the updates are measured against is computed once, before the
    first: advantages, the old logprobs (vLLM's, or the trainer's own with `tis_cap`), the frozen
    reference's logprobs, the critic's V_old. Returns the step's scalars, averaged over its
    optimizer steps (`train/optimizer_steps` of them); `per_optimizer_step`, if given, receives
    each optimizer step's own. `norm_len` is the constant of the seq-mean-token-sum-norm
    aggregation (max response length). `critic` (rft.trainer.critic.Critic, RL batches only): its
    values before the update feed the advantage estimator, its returns are the critic's targets,
    and it steps after each of the policy's steps. Microbatches: `micro_batch_size` rows padded, or
    with `max_tokens_per_microbatch` rows packed up to that many tokens (rft/trainer/microbatches.py).

    `skip_zero_advantage` (trainer.skip_zero_advantage_rows): rows whose advantage is 0 at every
    response token are not forwarded when nothing else in the loss reaches them (see
    `_rows_without_gradient`): their gradient is exactly 0, and every loss is still normalised by
    the whole (mini-)batch's counts, so the update is the one the full batch gives. Token
    statistics of the forward (`actor/entropy`, `actor/clipfrac`) then cover the rows trained;
    `train/rows_skipped` counts the others. A mini-batch with no row left takes no optimizer step
    (`train/steps_without_gradient`): its gradient is 0 everywhere, and Adam would only move the
    weights along its stale momentum."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, dp_group = _dp()
    device = next(model.parameters()).device
    is_rl = batch.rewards is not None

    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    packed = max_tokens_per_microbatch > 0

    def micro(rows: list[int]) -> list[list[int]]:
        return microbatches(rows, lengths, micro_batch_size, max_tokens_per_microbatch)

    mrope, patches = mrope_of(model), {}

    def images_of(i: int):
        """Row i's images cut into patches, once a step however many passes read them (the
        reference model's too)."""
        if i not in patches:
            patches[i] = image_inputs(model, batch.images[i]) if batch.images[i] else None
        return patches[i]

    def pack(idx_chunks):
        routes = batch.expert_routes
        return [pack_microbatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                                pad_id, device, [batch.mask_of(i) for i in idx], packed, sequence_multiple(model),
                                [routes[i] for i in idx] if routes is not None else None,
                                [images_of(i) for i in idx] if batch.images is not None else None, mrope)
                for idx in idx_chunks]

    use_ref = is_rl and ref_model is not None and algo.kl_coef > 0
    early = None  # advantages from the rewards alone, on every rank, when rows may be skipped
    if skip_zero_advantage and is_rl and batch.expert is None and not use_ref and critic is None and algo.entropy_coef == 0 \
            and algo.tis_cap is None and POLICY_LOSSES.meta(POLICY_LOSSES.resolve(algo.policy_loss)).get(
                "zero_at_zero_advantage"):
        early = batch_advantages(batch, algo, None)
    skipped = _rows_without_gradient(batch, early) if early is not None else set()
    step_rows = mini_batches(len(batch.prompt_ids), algo.mini_batch_size, dp_rank, dp_size)
    steps = [micro([i for i in rows if i not in skipped]) for rows in step_rows]
    step_mbs = [pack(chunks) for chunks in steps]
    chunks = [c for step in steps for c in step]  # this rank's rows, for the forwards before any update
    mbs = [mb for step in step_mbs for mb in step]
    rows = [i for step in step_rows for i in step]
    width = max((len(r) for r in batch.response_ids), default=0)
    ref_logprobs = None
    if use_ref and algo.kl_mode == "loss":
        ref_logprobs = _response_aligned(batch, chunks, forward_logprobs_pipelined(ref_model, mbs), width)
    ref_all = all_chunks = None
    if use_ref and algo.kl_mode == "reward":
        # the penalty enters batch-wide advantages: every row's reference logprobs are needed
        # (a pipelined forward: every stage takes part, the last one gets the logprobs)
        all_chunks = micro(list(range(len(batch.prompt_ids))))
        ref_all = forward_logprobs_pipelined(ref_model, pack(all_chunks))
    # V_old of every row (a pipelined collective; on the last stage): GAE's input, the value clip's anchor
    old_values = critic.values(batch, chunks, mbs) if is_rl and critic is not None else None
    advantages = returns = rollout_old = trainer_old = None
    if is_rl and ps.is_pipeline_last_stage():
        ref_response = _response_aligned(batch, all_chunks, ref_all, width) if ref_all is not None else None
        estimated = early if early is not None else batch_advantages(batch, algo, ref_response, old_values)
        advantages, returns = estimated.advantages, estimated.returns
        rollout_old = response_tensors(batch)[1]
    if is_rl and algo.tis_cap is not None:  # the trainer's own logprobs before any update: the PPO ratio's base
        trainer_old = _response_aligned(batch, chunks, forward_logprobs_pipelined(model, mbs), width)
    fixed = Fixed(advantages, rollout_old, trainer_old, ref_logprobs, old_values, returns)
    # a mini-batch whose every row (on every DP rank) was skipped has no gradient at all: no
    # optimizer step for it. Adam would still move the weights along its stale momentum: 40 such
    # steps in a row (a source of broken tasks) took held-out accuracy from 86.5% to 62%
    idle = [all(i in skipped for i in rows) for rows in mini_batch_rows(len(batch.prompt_ids), algo.mini_batch_size)]
    done, stepped = [], []  # every mini-batch's scalars; those of the optimizer steps taken
    for _epoch in range(algo.ppo_epochs):
        for all_rows, step_chunks, step_mb, nothing in zip(step_rows, steps, step_mbs, idle):
            if nothing:  # its scalars are those of the zero-gradient step it would have been
                done.append({"loss/policy": 0.0, "loss/kl": 0.0, "actor/grad_norm": 0.0, "actor/step_skipped": 0.0})
                continue
            stepped.append(_optimizer_step(model, optimizer, batch, algo, step_chunks, step_mb, fixed, norm_len,
                                           critic, all_rows, bool(skipped)))
            done.append(stepped[-1])
    if per_optimizer_step is not None:
        per_optimizer_step.extend(stepped)
    # each scalar's mean over the optimizer steps that have it (a step that trained no row has no entropy)
    metrics = {k: statistics.fmean(d[k] for d in done if k in d) for k in dict.fromkeys(k for d in done for k in d)}
    metrics["actor/step_skipped"] = sum(d["actor/step_skipped"] for d in done)
    metrics["train/tokens"] = _global_counts(batch, rows, dp_group, dp_size)[0]  # the batch's, once
    metrics["train/optimizer_steps"] = float(len(stepped))
    trained = [step for step, nothing in zip(steps, idle) if not nothing] * algo.ppo_epochs
    metrics["train/model_flops"] = _model_flops(model, lengths, chunks, trained, all_chunks,
                                                use_ref and algo.kl_mode == "loss", is_rl and algo.tis_cap is not None,
                                                is_rl and critic is not None)
    if is_rl and ADVANTAGES.meta(ADVANTAGES.resolve(algo.advantage)).get("needs_teacher"):
        metrics.update(teacher_scalars(batch))
    if early is not None:
        metrics["train/rows_skipped"] = float(len(skipped))  # the batch's (every rank computes the same set)
        metrics["train/steps_without_gradient"] = float(len(done) - len(stepped))
    return metrics


def _model_flops(model, lengths: list[int], chunks: list[list[int]], trained: list[list[list[int]]],
                 reference_rows: list[list[int]] | None, reference: bool, own_old: bool, critic: bool) -> float:
    """This rank's model FLOPs in the step (rft/trainer/flops.py): a forward and backward over the
    rows of each optimizer step taken (`trained`, with the critic's own step after each), and the
    forwards before any update over this rank's rows (`chunks`): the reference's (`reference`; or
    of every row, `reference_rows`, under kl_mode=reward), the trainer's old logprobs (`own_old`),
    the critic's values (`critic`)."""
    def tokens(rows: list[list[int]]) -> int:
        return sum(lengths[i] for chunk in rows for i in chunk)

    forwards = tokens(chunks) * (reference + own_old + critic) + tokens(reference_rows or [])
    passes = sum(tokens(step) for step in trained) * (2 if critic else 1)
    return float(parameter_count(model) * (FORWARD * forwards + FORWARD_BACKWARD * passes))


def _rows_without_gradient(batch: StepBatch, estimated: AdvantageOutputs) -> set[int]:
    """Rows whose advantage is 0 at every response token to train: a group whose samples all scored
    the same, under a group-relative estimator. Called only when the loss is the policy term alone
    (no KL to a reference, no entropy bonus, no critic, no trainer-side importance weights) and the
    policy loss is registered `zero_at_zero_advantage` (its per-token loss and gradient are 0
    where the advantage is), so such a row adds exactly nothing to the update."""
    mask, _ = response_tensors(batch)
    moved = (estimated.advantages * mask).abs().sum(dim=1)
    return {i for i in range(len(batch.response_ids)) if moved[i] == 0}


@dataclass
class Fixed:
    """What a batch's optimizer steps are measured against, computed before the first, response-
    aligned [B, T_resp] (None where unused, and on all but the last pipeline stage)."""

    advantages: torch.Tensor | None
    rollout_old: torch.Tensor | None  # vLLM's logprobs
    trainer_old: torch.Tensor | None  # the trainer's own before the update (tis_cap)
    ref_logprobs: torch.Tensor | None  # the frozen reference's (kl_mode=loss)
    old_values: torch.Tensor | None  # the critic's V_old
    returns: torch.Tensor | None  # the critic's targets


def _response_aligned(batch: StepBatch, chunks: list[list[int]], packed: list[torch.Tensor] | None,
                      width: int) -> torch.Tensor | None:
    """Per-microbatch values (a pipelined forward's, None off the last stage) as [B, width]."""
    if packed is None:
        return None
    out = torch.zeros(len(batch.prompt_ids), width)
    for idx, values in zip(chunks, packed):
        take_from_microbatch(batch, idx, values.float().cpu(), out)
    return out


def _optimizer_step(model, optimizer: TrainerOptimizer, batch: StepBatch, algo: AlgorithmConfig,
                    chunks: list[list[int]], mbs: list[Microbatch], fixed: Fixed, norm_len: int,
                    critic, all_rows: list[int], skipping: bool) -> dict[str, float]:
    """One optimizer step on the rows of `chunks` (this DP rank's share of a mini-batch, packed as
    `mbs`; `all_rows` with the rows skipped for a zero advantage), the loss normalised by the
    mini-batch's counts over every DP rank. `skipping`: the batch has skipped rows (the same on
    every rank, which all take part in the count of the rows trained)."""
    _, dp_size, dp_group = _dp()
    is_rl = batch.rewards is not None
    num_tokens, num_seqs = _global_counts(batch, all_rows, dp_group, dp_size)
    trained_tokens = _global_counts(batch, [i for c in chunks for i in c], dp_group, dp_size, False)[0] \
        if skipping else num_tokens
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "actor/entropy": 0.0, "actor/clipfrac": 0.0, "actor/is_weight": 0.0}
    policy_loss = POLICY_LOSSES.resolve(algo.policy_loss if is_rl else "sft")  # no rewards: reference answers
    aggregate = AGGREGATIONS.resolve(algo.loss_agg)
    kl_in_loss = is_rl and fixed.ref_logprobs is not None
    chord = is_rl and batch.expert is not None  # CHORD: sampled rows and expert rows, each part normalised alone
    if chord:
        parts = {part: _global_counts(batch, [i for i in all_rows if batch.expert[i] == part], dp_group, dp_size)
                 for part in (False, True)}
        width = max((len(r) for r in batch.response_ids), default=0)
        experts = torch.tensor(batch.expert, dtype=torch.float32).reshape(-1, 1).expand(len(batch.expert), width)
        sums.update({"loss/chord_rl": 0.0, "loss/chord_sft": 0.0})

    def mixed(m: int, mask: torch.Tensor, logprobs: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
        """(1 - mu) * the RL loss over the sampled rows + mu * the expert rows' SFT loss (rft/algorithms/chord.py)."""
        expert_mask = mask * place_in_microbatch(batch, chunks[m], experts, logprobs)
        rl_mask = mask - expert_mask
        expert_loss = expert_token_loss(logprobs, expert_mask, algo.chord_phi)
        sums["loss/chord_rl"] += float(zero_padding(per_token, rl_mask).detach().sum())
        sums["loss/chord_sft"] += float(expert_loss.detach().sum())
        (rl_tokens, rl_seqs), (expert_tokens, _) = parts[False], parts[True]
        mu = batch.expert_weight
        return (1.0 - mu) * aggregate(per_token, rl_mask, num_tokens=rl_tokens, num_seqs=rl_seqs, norm_len=norm_len) \
            + mu * expert_loss.sum() / expert_tokens

    def loss_fn(m: int, mb: Microbatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        mask = mb.loss_mask
        tokens = mask.sum().item()
        view = SimpleNamespace(**asdict(algo))
        if is_rl:
            old = place_in_microbatch(batch, chunks[m], fixed.rollout_old, logprobs)
            adv = place_in_microbatch(batch, chunks[m], fixed.advantages, logprobs)
            if fixed.trainer_old is not None:
                trainer_old = place_in_microbatch(batch, chunks[m], fixed.trainer_old, logprobs)
                view.is_weights = truncated_is_weights(trainer_old, old, algo.tis_cap, mask)
                sums["actor/is_weight"] += masked_token_mean(view.is_weights, mask).item() * tokens
                old = trainer_old
        else:
            old = adv = torch.zeros_like(logprobs)
        per_token, metrics = policy_loss(logprobs, old, adv, mask, view)
        sums["loss/policy"] += masked_token_mean(per_token, mask).item() * tokens
        if "clipfrac" in metrics:
            sums["actor/clipfrac"] += float(metrics["clipfrac"]) * tokens
        if kl_in_loss:
            kl = KL_ESTIMATORS.resolve(algo.kl_estimator)(logprobs, place_in_microbatch(batch, chunks[m], fixed.ref_logprobs,
                                                                           logprobs))
            per_token = per_token + algo.kl_coef * kl
            sums["loss/kl"] += masked_token_mean(kl, mask).item() * tokens
        if entropy is not None:
            sums["actor/entropy"] += masked_token_mean(entropy, mask).item() * tokens
            if algo.entropy_coef:
                per_token = per_token - algo.entropy_coef * entropy
        if chord:
            return mixed(m, mask, logprobs, per_token)
        return aggregate(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)

    sums, result = backward_and_step(model, optimizer, mbs, loss_fn, sums, algo.grad_clip)
    # the loss terms over every token of the mini-batch (a skipped row's are 0); the forward's own
    # statistics over the tokens it saw
    forward_stats = ("actor/entropy", "actor/clipfrac", "actor/is_weight")
    metrics = {k: v / (trained_tokens if k in forward_stats else num_tokens) for k, v in sums.items()
               if trained_tokens or k not in forward_stats}  # no row trained: no entropy to report, not 0
    if algo.tis_cap is None or not is_rl:  # (trainer_old is None on all but the last PP stage)
        metrics.pop("actor/is_weight", None)
    if chord:  # each part's per-token loss over its own tokens, and its weight
        metrics["loss/chord_rl"] = sums["loss/chord_rl"] / parts[False][0]
        metrics["loss/chord_sft"] = sums["loss/chord_sft"] / parts[True][0]
        metrics["chord/mu"] = batch.expert_weight
    metrics.update(step_scalars(result))
    if not is_rl:
        metrics["loss/sft"] = metrics["loss/policy"]
    if is_rl and critic is not None:
        metrics.update(critic.update(batch, chunks, mbs, fixed.old_values, fixed.returns, algo, num_tokens, num_seqs,
                                     norm_len))
    return metrics
