"""Policy losses: per-token losses from current/old logprobs and advantages, plus DPO and TIS.
More built-ins register into POLICY_LOSSES from `offpolicy.py` (rec, topr, sppo, sapo, reinforce),
which the package imports.

Registry POLICY_LOSSES, signature

    fn(logprobs [B, T], old_logprobs [B, T], advantages [B, T] (or [B]), mask [B, T], cfg)
        -> (per_token_loss [B, T], metrics: dict[str, Tensor])

The per-token loss is 0 where mask is 0 (padding may hold anything, even inf/NaN, without
touching the result or its gradient) and is reduced by an aggregation (`aggregation.py`), so one
loss works with every aggregation mode. Metrics are detached token-means over THIS call's valid
tokens; weight them by its token count to combine microbatches.

`cfg` is any object (or None); built-ins read these attributes with defaults:
    clip_eps: float = 0.2             ppo, gspo: lower clip, ratio >= 1 - clip_eps
    clip_eps_high: float | None = None   ppo, gspo: upper clip, ratio <= 1 + clip_eps_high;
                                      None -> clip_eps (DAPO "clip-higher" when larger)
    dual_clip_c: float | None = None  ppo: dual-clip bound for A < 0 (e.g. 3.0; must be > 1)
    cispo_clip_high: float = 0.28     cispo: IS weight <= 1 + cispo_clip_high (Trinity-RFT's
                                      default; MiniMax-M1 tunes only this bound)
    cispo_clip_low: float | None = None  cispo: IS weight >= 1 - cispo_clip_low; None = no lower
                                      bound (MiniMax-M1)
    is_weights: Tensor [B, T] | None = None  per-token importance weights multiplied into the
                                      loss (e.g. `truncated_is_weights` for vLLM/trainer mismatch);
                                      per microbatch, so set it on a per-call copy of the config
                                      (dataclasses.replace or types.SimpleNamespace). Not "sft".

Metadata: `zero_at_zero_advantage=True` (a user's loss: `fn.rft_meta = {"zero_at_zero_advantage":
True}`) promises that where the advantage is 0 the per-token loss and its gradient are 0, so the
trainer may leave rows whose advantages are all 0 out of the forward
(trainer.skip_zero_advantage_rows, rft/trainer/train_step.py).
"""

from __future__ import annotations

import math
from typing import Any

from rft.algorithms.aggregation import masked_token_mean, zero_padding
from rft.lazy import lazy_module
from rft.registry import Registry

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")
F = lazy_module("torch.nn.functional")

POLICY_LOSSES = Registry("policy loss", params=("logprobs", "old_logprobs", "advantages", "mask", "cfg"),
                         returns="tuple[per_token_loss [B, T], dict[str, Tensor]]")

# exp of a log-ratio beyond this overflows or means the sample is hopelessly off-policy; verl
# clamps PPO's log-ratio to [-20, 20] and GSPO's to <= 10 for the same reason.
MAX_LOG_RATIO = 20.0
MAX_GSPO_LOG_RATIO = 10.0

Metrics = dict[str, "torch.Tensor"]


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] (one per response) or [B, T] -> [B, T], detached, 0 on padding."""
    if advantages.dim() == 1:
        advantages = advantages.reshape(-1, 1).expand(mask.shape)
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(mask.shape)}, "
                         f"got {tuple(advantages.shape)}")
    return zero_padding(advantages.detach(), mask)


def _clip_bounds(cfg: Any) -> tuple[float, float]:
    """(1 - clip_eps, 1 + clip_eps_high) with clip_eps_high defaulting to clip_eps."""
    low = getattr(cfg, "clip_eps", 0.2)
    high = getattr(cfg, "clip_eps_high", None)
    return 1.0 - low, 1.0 + (low if high is None else high)


def _finish(per_token: torch.Tensor, mask: torch.Tensor, cfg: Any) -> torch.Tensor:
    """Multiply in cfg.is_weights if set, and zero the padding."""
    weights = getattr(cfg, "is_weights", None)
    if weights is not None:
        per_token = per_token * zero_padding(weights.detach(), mask)
    return zero_padding(per_token, mask)


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                       cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """max(-A * ratio, -A * clip(ratio, low, high)): PPO's pessimistic bound, per token."""
    low, high = _clip_bounds(cfg)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"clipfrac": masked_token_mean((clipped > unclipped).float(), mask).detach()}


@POLICY_LOSSES.register("ppo", zero_at_zero_advantage=True)
def ppo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric bounds (DAPO clip-higher) and optional dual-clip.

    Dual-clip (Ye et al., as verl's compute_policy_loss): for A < 0 a huge ratio makes the clipped
    surrogate unbounded, so the loss is additionally capped at -A * c. Metrics: clipfrac,
    clipfrac_lower (tokens where the dual-clip bound binds), approx_kl (mean old - new logprob).
    """
    logprobs, old_logprobs = zero_padding(logprobs, mask), zero_padding(old_logprobs, mask)
    adv = _token_advantages(advantages, mask)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    loss, metrics = _clipped_surrogate(torch.exp(log_ratio), adv, mask, cfg)
    c = getattr(cfg, "dual_clip_c", None)
    lower_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if c is not None:
        if c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (got {c}); e.g. 3.0, or None to disable")
        cap = -adv * c
        lower_clipped = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    metrics["clipfrac_lower"] = masked_token_mean(lower_clipped.float(), mask).detach()
    metrics["approx_kl"] = masked_token_mean(-log_ratio, mask).detach()
    return _finish(loss, mask, cfg), metrics


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """[B]: mean over valid tokens of log(pi / pi_old), i.e. log of GSPO's s_i (0 for no tokens)."""
    diff = zero_padding(logprobs - old_logprobs, mask)
    return diff.sum(dim=-1) / mask.bool().sum(dim=-1).clamp(min=1)


@POLICY_LOSSES.register("gspo", zero_at_zero_advantage=True)
def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al., Qwen), GSPO-token form as in verl's compute_policy_loss_gspo.

    s_i = exp(mean_t log(pi/pi_old)) is the length-normalised sequence ratio. Each token's ratio is
    sg(s_i) * pi_t / sg(pi_t): its value is s_i, its gradient s_i * grad log pi_t, so summing the
    per-token losses of a sequence gives the gradient of |y_i| * s_i (GSPO's sequence gradient
    up to the aggregation's weight). Clipped like PPO, with the same clip_eps / clip_eps_high;
    GSPO's paper uses far smaller ranges (3e-4 / 4e-4) than token-level PPO.
    """
    logprobs, old_logprobs = zero_padding(logprobs, mask), zero_padding(old_logprobs, mask)
    adv = _token_advantages(advantages, mask)
    seq_log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=MAX_GSPO_LOG_RATIO))
    loss, metrics = _clipped_surrogate(ratio, adv, mask, cfg)
    metrics["approx_kl"] = masked_token_mean(old_logprobs - logprobs, mask).detach()
    return _finish(loss, mask, cfg), metrics


@POLICY_LOSSES.register("cispo", zero_at_zero_advantage=True)
def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1): REINFORCE weighted by a clipped, stop-gradient IS weight.

    loss_t = -sg(clip(ratio_t, 1 - cispo_clip_low, 1 + cispo_clip_high)) * A_t * log pi_t. Unlike
    PPO no token's gradient is dropped when the ratio leaves the range; only its weight is capped.
    Metrics: clipfrac (tokens whose weight was clipped), approx_kl.
    """
    logprobs, old_logprobs = zero_padding(logprobs, mask), zero_padding(old_logprobs, mask)
    adv = _token_advantages(advantages, mask)
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).detach()
    ratio = torch.exp(log_ratio)
    low = getattr(cfg, "cispo_clip_low", None)
    weight = ratio.clamp(min=None if low is None else 1.0 - low,
                         max=1.0 + getattr(cfg, "cispo_clip_high", 0.28))
    metrics = {"clipfrac": masked_token_mean((weight != ratio).float(), mask).detach(),
               "approx_kl": masked_token_mean(-log_ratio, mask).detach()}
    return _finish(-weight * adv * logprobs, mask, cfg), metrics


@POLICY_LOSSES.register("sft")
def sft(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood of the response tokens; advantages, old logprobs and is_weights
    are ignored (the target is a reference answer, not a sample)."""
    return zero_padding(-logprobs, mask), {}


def truncated_is_weights(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """min(pi_trainer / pi_rollout, cap) per token, detached: truncated importance sampling (TIS,
    as verl's rollout correction) for the mismatch between vLLM's and the trainer's logprobs.

    0 where mask is 0 and where the log-ratio is undefined (NaN, e.g. -inf minus -inf on padding);
    the log-ratio is capped at log(cap) before exp so a large gap cannot overflow.
    """
    if cap <= 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0 (got {cap}); e.g. 2.0")
    log_ratio = (trainer_logprobs - rollout_logprobs).detach()
    invalid = torch.isnan(log_ratio)
    if mask is not None:
        invalid = invalid | ~mask.bool()
    log_ratio = log_ratio.masked_fill(invalid, -math.inf).clamp(max=math.log(cap))
    return torch.exp(log_ratio)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, Metrics]:
    """DPO (Rafailov et al.; TRL's sigmoid loss) on sequence-summed logprobs, one row per pair.

    loss_p = -log sigmoid(beta * ((c - ref_c) - (r - ref_r))). Metrics (detached means over the
    pairs): rewards/chosen, rewards/rejected (beta * policy-vs-reference log-ratios),
    rewards/accuracy (share of pairs whose chosen reward is higher), rewards/margin.
    """
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    margin = chosen_rewards - rejected_rewards
    metrics = {"rewards/chosen": chosen_rewards.detach().mean(),
               "rewards/rejected": rejected_rewards.detach().mean(),
               "rewards/accuracy": (margin.detach() > 0).float().mean(),
               "rewards/margin": margin.detach().mean()}
    return -F.logsigmoid(margin), metrics
