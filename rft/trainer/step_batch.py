"""The rows a trainer step trains on (`StepBatch`), and what is computed over the whole batch
before it is split into microbatches: response-aligned tensors (mask, vLLM's logprobs, the
teacher's), the advantages, the teacher's scalars. rft/trainer/train_step.py runs the step."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutputs
from rft.algorithms.aggregation import masked_token_mean
from rft.algorithms.kl import kl_penalty_rewards
from rft.algorithms.turn_credit import turn_tensors
from rft.config import AlgorithmConfig


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
    # per-turn credit (advantage estimators with per_turn=True, rft/algorithms/turn_credit.py): each
    # row's step rewards (None: none recorded), its first turn (step_wise: its step) and its model turns
    step_rewards: list[list[float] | None] | None = None
    step_index: list[int] | None = None
    turns: list[int] | None = None
    # on-policy distillation (advantage estimators with needs_teacher=True, rft/algorithms/
    # distillation.py): each row's teacher logprobs per response token, None where it was not scored
    teacher_logprobs: list[list[float] | None] | None = None
    # routing replay (trainer.routing_replay=rollout): each row's routed experts [tokens, layers, k]
    expert_routes: list | None = None
    # CHORD (rft/algorithms/chord.py): which rows are expert demonstrations, and their part's share
    # of the loss this step (mu)
    expert: list[bool] | None = None
    expert_weight: float = 0.0
    # a vision-language model's rows: each row's images, encoded (PNG, JPEG, ...), or None
    images: list[list[bytes] | None] | None = None

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
                   trajectory_ids=group_index([e.trajectory_id or i for i, e in enumerate(experiences)]).tolist(),
                   step_rewards=[e.step_rewards for e in experiences], step_index=[e.step_index for e in experiences],
                   turns=[e.turns for e in experiences],
                   teacher_logprobs=[None if e.teacher_logprobs is None else e.teacher_logprobs[p:]
                                     for e, p in zip(experiences, cut)],
                   images=[e.images for e in experiences] if any(e.images for e in experiences) else None)

    def with_expert_routes(self, experiences: list) -> "StepBatch":
        """This batch with the rows' routed experts to replay (trainer.routing_replay=rollout)."""
        missing = [e.trajectory_id or str(i) for i, e in enumerate(experiences) if e.routed_experts is None]
        if missing:
            raise ValueError(f"trainer.routing_replay=rollout: {len(missing)} experience row(s) carry no routed "
                             f"experts (trajectory {missing[0]}); rows must come from vLLM generations with "
                             "routing returned (written by this run's explorer)")
        self.expert_routes = [e.routed_experts for e in experiences]
        return self

    def with_expert_rows(self, demonstrations: "StepBatch", mu: float) -> "StepBatch":
        """This RL batch with SFT rows (prompt + expert answer) appended, CHORD's expert part at
        weight `mu`. An expert row has no reward, sampling logprobs or group of its own that an
        estimator could see: advantages are computed over the sampled rows only."""
        n, k = len(self.prompt_ids), len(demonstrations.prompt_ids)
        groups, trajectories = max(self.group_ids, default=-1) + 1, max(self.trajectory_ids or [n - 1], default=-1) + 1
        return StepBatch(
            prompt_ids=self.prompt_ids + demonstrations.prompt_ids,
            response_ids=self.response_ids + demonstrations.response_ids,
            response_mask=[self.mask_of(i) for i in range(n)] + [demonstrations.mask_of(i) for i in range(k)],
            rewards=self.rewards + [0.0] * k,
            old_logprobs=self.old_logprobs + [[0.0] * len(r) for r in demonstrations.response_ids],
            group_ids=self.group_ids + list(range(groups, groups + k)),
            trajectory_ids=(self.trajectory_ids or list(range(n))) + list(range(trajectories, trajectories + k)),
            step_rewards=None if self.step_rewards is None else self.step_rewards + [None] * k,
            step_index=None if self.step_index is None else self.step_index + [0] * k,
            turns=None if self.turns is None else self.turns + [0] * k,
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs + [None] * k,
            expert=[False] * n + [True] * k, expert_weight=mu,
            images=None if self.images is None and demonstrations.images is None
            else (self.images or [None] * n) + (demonstrations.images or [None] * k))

    def rows(self, keep: list[int]) -> "StepBatch":
        """The batch of rows `keep` (in that order): every per-row field picked, the rest kept."""
        picked = {f.name: [getattr(self, f.name)[i] for i in keep] if isinstance(getattr(self, f.name), list)
                  else getattr(self, f.name) for f in fields(self)}
        return StepBatch(**picked)

    def mask_of(self, i: int) -> list[int]:
        """Row i's response mask (all ones for reference answers)."""
        return self.response_mask[i] if self.response_mask is not None else [1] * len(self.response_ids[i])


def pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def place_in_microbatch(batch: StepBatch, idx: list[int], per_response: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Response-aligned values [B, T_resp] (row i = batch row i) at the response targets of a
    microbatch of rows `idx` (packed prompt + response, targets shifted by one)."""
    width = like.shape[1]
    out = torch.zeros_like(like)
    for row, i in enumerate(idx):
        p, n = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        out[row, p - 1: p - 1 + n] = per_response[i, : min(n, width - p + 1)].to(like)
    return out


def take_from_microbatch(batch: StepBatch, idx: list[int], packed: torch.Tensor, out: torch.Tensor) -> None:
    """The inverse of `place_in_microbatch`: copy a microbatch's response-target values into rows of `out`."""
    for row, i in enumerate(idx):
        p, n = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        out[i, :n] = packed[row, p - 1: p - 1 + n]


def response_tensors(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, vLLM logprobs), both [B, longest response], response-aligned; the mask is 1 on the
    response tokens to train."""
    width = max((len(r) for r in batch.response_ids), default=0)
    return pad_rows([batch.mask_of(i) for i in range(len(batch.response_ids))], width), \
        pad_rows(batch.old_logprobs, width)


def batch_advantages(batch: StepBatch, algo: AlgorithmConfig, ref_response_logprobs: torch.Tensor | None,
                     values: torch.Tensor | None = None) -> AdvantageOutputs:
    """Token advantages [B, T_resp] over the whole batch (batch-normalising estimators such as
    REINFORCE++ need every row), and returns where the estimator gives them; with `kl_mode=reward`
    the KL to the reference is a per-token reward penalty, measured on vLLM's (behaviour)
    logprobs. `values`: the critic's response-aligned values (gae).

    Rows of one trajectory (step_wise) and a per-response estimator (grpo, rloo, ...): the
    estimator sees each trajectory once, with its group, so a trajectory of many steps weighs
    the same in its group's baseline as one of few; each row gets its trajectory's advantage."""
    if batch.expert is not None:  # CHORD: the estimator sees the sampled rows; expert rows get 0
        sampled = [i for i, expert in enumerate(batch.expert) if not expert]
        width = max((len(batch.response_ids[i]) for i in sampled), default=0)
        own = replace(batch.rows(sampled), expert=None)
        part = batch_advantages(own, algo,
                                None if ref_response_logprobs is None else ref_response_logprobs[sampled, :width],
                                None if values is None else values[sampled, :width])
        mask, _ = response_tensors(batch)
        advantages = torch.zeros_like(mask)
        advantages[sampled, : part.advantages.shape[1]] = part.advantages
        returns = None
        if part.returns is not None:
            returns = torch.zeros_like(mask)
            returns[sampled, : part.returns.shape[1]] = part.returns
        return AdvantageOutputs(advantages=advantages, returns=returns)
    mask, old = response_tensors(batch)
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
    if ADVANTAGES.meta(estimator).get("needs_teacher"):
        inputs.old_logprobs, inputs.teacher_logprobs, inputs.teacher_scored = old, *teacher_tensors(batch, mask)
    if ADVANTAGES.meta(estimator).get("per_turn"):  # which tokens are which turn's, and each turn's reward
        inputs.turn_ids, inputs.turn_rewards = turn_tensors(mask, batch.rewards, batch.step_rewards,
                                                            batch.step_index, batch.turns)
    return estimator(inputs, algo)


def teacher_tensors(batch: StepBatch, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's logprobs [B, T_resp] (0 on rows it did not score) and which rows it scored [B]."""
    rows = batch.teacher_logprobs or [None] * len(batch.response_ids)
    scored = torch.tensor([float(r is not None) for r in rows])
    return pad_rows([r if r is not None else [] for r in rows], mask.shape[1]), scored


def teacher_scalars(batch: StepBatch) -> dict[str, float]:
    """distill/reverse_kl: the mean over the scored rows' sampled tokens of log pi_s - log pi_t
    (the student's sampling logprob minus the teacher's: the reverse KL's estimate, 0 when the
    student samples as the teacher would); distill/rows_unscored: rows the teacher did not score."""
    mask, old = response_tensors(batch)
    teacher, scored = teacher_tensors(batch, mask)
    valid = mask * scored.reshape(-1, 1)
    return {"distill/reverse_kl": masked_token_mean(old - teacher, valid).item() if valid.any() else 0.0,
            "distill/rows_unscored": float((scored == 0).sum())}
