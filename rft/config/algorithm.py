"""The `algorithm` section: what a training step computes (presets in conf/algorithm/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LR_DECAYS = ("constant", "linear", "cosine")  # algorithm.lr_decay (rft/trainer/optimizer.py)


@dataclass
class AlgorithmConfig:
    """What a step computes. Presets: conf/algorithm/<name>.yaml (`algorithm=dapo`); the registry
    keys (advantage, policy_loss, kl_estimator, loss_agg, sample_filter) take a built-in name or a
    dotted path to your own function (signatures in rft/algorithms/*.py, checked at launch)."""

    name: str = "grpo"  # a label (the preset's name); the keys below decide what runs
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | gae (with a critic) | grpo_per_turn | asymre | reinforce | on_policy_distill, jsd (a teacher: judge.model) (rft/algorithms/)
    policy_loss: str = "ppo"  # ppo | gspo | cispo | rec | topr | sppo | sapo | reinforce | sft | dpo (rft/algorithms/); sft, dpo: no rollouts
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_norm_len: int = 0  # seq-mean-token-sum-norm's constant (0: rollout.max_new_tokens)
    sample_filter: str = "none"  # none | zero_variance (DAPO dynamic sampling; the explorer refills)
    group_size: int = 8  # samples per task (GRPO group)
    clip_eps: float = 0.2  # PPO ratio clip (lower side)
    clip_eps_high: Optional[float] = None  # upper side (DAPO clip-higher); None: clip_eps
    dual_clip_c: Optional[float] = None  # dual-clip bound for negative advantages (e.g. 3.0); None: off
    cispo_clip_high: float = 0.28  # CISPO: IS weight capped at 1 + this
    rec_clip: str = "one-side"  # rec: which tokens keep a gradient: one-side | two-side | ring | none (plain REINFORCE)
    rec_importance_sampling: bool = False  # rec: weight each token by sg(pi / pi_old) (the REC-*-IS variants)
    rec_ring_eps_low: float = 0.6  # rec_clip=ring: A > 0 tokens with ratio <= 1 - this keep their gradient too
    rec_ring_eps_high: float = 2.0  # rec_clip=ring: A < 0 tokens with ratio >= 1 + this keep their gradient too
    topr_ratio: str = "sequence"  # topr: negatives weighted by min(pi / mu, 1) of the response (sequence) or token
    sppo_eps: float = 0.3  # sppo: tokens keep their gradient while 1 / (1 + this) <= ratio <= 1 + this
    sapo_tau_pos: float = 1.0  # sapo: soft-gate temperature for A > 0 (larger: the gate closes sooner off-policy)
    sapo_tau_neg: float = 1.05  # sapo: soft-gate temperature for A <= 0 (the paper keeps it above sapo_tau_pos)
    asymre_baseline_shift: float = -0.1  # advantage=asymre: baseline = group mean + this (< 0: positives weigh more)
    reinforce_baseline: float = 0.0  # advantage=reinforce: A = reward - this constant (topr preset: 0.5)
    tis_cap: Optional[float] = None  # truncated IS between trainer and vLLM logprobs (e.g. 2.0); None: off
    norm_adv_by_std: bool = True  # divide group-centred rewards by the group std (GRPO)
    gamma: float = 1.0  # discount: per token (reinforce_pp, gae), per model turn (grpo_per_turn)
    lam: float = 1.0  # GAE lambda
    critic_lr: float = 1e-5  # gae: AdamW learning rate of the critic (value model, rft/trainer/critic.py)
    value_clip: Optional[float] = 0.2  # gae: the critic's values move at most this far from V_old per step; None: off
    expert_rows: int = 0  # CHORD: expert demonstrations (data.expert_path, else the taskset's answers) mixed into each RL step (0: none)
    chord_mu_peak: float = 0.1  # CHORD: the expert (SFT) part's share of the loss at its peak
    chord_mu_valley: float = 0.1  # CHORD: its share after the decay
    chord_mu_warmup_steps: int = 0  # CHORD: steps of linear warm-up from 0 to chord_mu_peak
    chord_mu_decay_steps: int = 0  # CHORD: steps of cosine decay from chord_mu_peak to chord_mu_valley (0: constant peak)
    chord_phi: bool = True  # CHORD-phi: weight each expert token's NLL by p (1 - p), p the policy's probability of it
    distill_coef: float = 1.0  # on_policy_distill, jsd: advantage = -this x the per-token divergence to the teacher (judge.model)
    jsd_beta: float = 0.5  # jsd: the teacher's weight in the mixture m = beta * teacher + (1 - beta) * student (0.5: symmetric JSD)
    kl_coef: float = 0.0  # weight of the KL to a frozen reference model (0: no reference)
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl (rft/algorithms/kl.py)
    kl_mode: str = "loss"  # loss: a loss term | reward: a per-token reward penalty (reinforce_pp, gae)
    entropy_coef: float = 0.0  # entropy bonus weight
    dpo_beta: float = 0.1  # DPO: strength of the implicit KL to the reference (policy_loss=dpo, mode=train)
    reward: str = "exact_match"  # exact_match | math_verify | llm_judge, relative_judge (ask the judge engines) | your function: file.py:fn or a dotted path (verl's compute_score signature accepted)
    ppo_epochs: int = 1  # passes over each rollout batch (old logprobs, advantages fixed for the batch)
    mini_batch_size: int = 0  # rows per optimizer step (0: the whole batch); steps = ppo_epochs x ceil(rows / this)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global grad norm (0: no clipping)
    warmup_steps: int = 0  # linear LR warm-up steps
    lr_decay: str = "constant"  # after warm-up: constant | linear | cosine (to min_lr_ratio x lr at the stage's end)
    min_lr_ratio: float = 0.0  # lr_decay linear/cosine: the last step's lr as a share of lr
