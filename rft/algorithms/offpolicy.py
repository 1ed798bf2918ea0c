"""The off-policy REINFORCE family: the REC, TOPR, sPPO, SAPO and REINFORCE policy losses, and the
AsymRE and constant-baseline ("reinforce") advantages.

The losses register in POLICY_LOSSES (`policy_losses.py`: same signature and conventions, a
per-token loss [B, T] that is exactly 0 on padding, metrics over this call's valid tokens), the
advantages in ADVANTAGES (`advantages.py`: one advantage per response broadcast over its valid
tokens, 0 on padding). The package imports this module (`rft/algorithms/__init__.py`), so every
user of either registry sees these names.

Notation: r_t = pi(y_t) / pi_old(y_t) is a token's ratio to the policy that sampled it (vLLM's
logprobs, or the trainer's own with `tis_cap`), A the advantage, sg() a stop-gradient. Each function
states its formula; `docs/guides/algorithms.md` has them with their papers. The losses all reduce
to REINFORCE's -A * log pi_t on policy and differ in what they do to a token once pi has moved from
pi_old: drop its gradient (REC's masks, sPPO), weight it down (TOPR for negative samples, SAPO's
soft gate), or nothing (REINFORCE, the loss of AsymRE, whose baseline does the work). On policy a
baseline only changes the variance of REINFORCE's gradient; off policy it changes what the update
converges to, hence the two advantages here.

`cfg` attributes read, with the papers' defaults (AlgorithmConfig has the same):
    clip_eps: float = 0.2, clip_eps_high: float | None = None
                                    rec: the band [1 - clip_eps, 1 + clip_eps_high] (None: clip_eps)
    rec_clip: str = "one-side"      rec: none | one-side | two-side | ring (which tokens keep a gradient)
    rec_importance_sampling: bool = False   rec: weight tokens by sg(r_t) (the "-IS" variants)
    rec_ring_eps_low: float = 0.6, rec_ring_eps_high: float = 2.0   rec ring: the outer band
    topr_ratio: str = "sequence"    topr: the truncated ratio is the response's (sequence) or each token's
    sppo_eps: float = 0.3           sppo: the band [1 / (1 + eps), 1 + eps]
    sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05   sapo: the soft gate's temperatures
    is_weights: Tensor [B, T] | None   multiplied into every loss here (see policy_losses.py)
    asymre_baseline_shift: float = -0.1   advantage asymre: baseline = group mean + this
    reinforce_baseline: float = 0.0       advantage reinforce: A = reward - this

Every loss here is registered `zero_at_zero_advantage`: each is a product with A, so where A = 0
the loss and its gradient are exactly 0. Both advantages are registered `per_response=True`;
"asymre" also `needs_group=True` (it compares a task's samples with each other, so the launch
checks refuse algorithm.group_size < 2 for it).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rft.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    AdvantageOutputs,
    _broadcast,
    _group_rewards,
    group_stats,
)
from rft.algorithms.aggregation import masked_token_mean, zero_padding
from rft.algorithms.policy_losses import MAX_LOG_RATIO, POLICY_LOSSES, Metrics, _finish, _token_advantages
from rft.lazy import lazy_module

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")

REC_CLIPS = ("none", "one-side", "two-side", "ring")
TOPR_RATIOS = ("sequence", "token")

# name -> (default, the check its value must pass, the fix to print when it does not); the
# defaults are the papers' (AlgorithmConfig has the same), `option_problem` checks a config at launch
_OPTIONS: dict[str, tuple[Any, Callable[[Any], bool], str]] = {
    "rec_clip": ("one-side", lambda v: v in REC_CLIPS, f"use one of {', '.join(REC_CLIPS)}"),
    "rec_ring_eps_low": (0.6, lambda v: 0 < v <= 1, "use a value in (0, 1], e.g. 0.6 (REC-Ring's paper value)"),
    "rec_ring_eps_high": (2.0, lambda v: v > 0, "use a positive value, e.g. 2.0 (REC-Ring's paper value)"),
    "topr_ratio": ("sequence", lambda v: v in TOPR_RATIOS, f"use one of {', '.join(TOPR_RATIOS)}"),
    "sppo_eps": (0.3, lambda v: v > 0, "use a positive value, e.g. 0.3 (the band [1/1.3, 1.3])"),
    "sapo_tau_pos": (1.0, lambda v: v > 0, "use a positive temperature, e.g. 1.0 (SAPO's paper value)"),
    "sapo_tau_neg": (1.05, lambda v: v > 0, "use a positive temperature, e.g. 1.05 (SAPO's paper value)"),
}


def option_problem(cfg: Any) -> tuple[str, Any, str] | None:
    """The first of this module's options in `cfg` that is out of range, as (key, value, fix), or
    None. Run at launch by the config checks (rft/config/plugin_checks.py), so a bad value fails on
    the login node; the losses run the same check on the options they read."""
    for key in _OPTIONS:
        problem = _check(cfg, key)
        if problem is not None:
            return problem
    return None


def _check(cfg: Any, key: str) -> tuple[str, Any, str] | None:
    default, valid, fix = _OPTIONS[key]
    value = getattr(cfg, key, default)
    return None if valid(value) else (key, value, fix)


def _option(cfg: Any, key: str) -> Any:
    """cfg.<key> (its default when absent); ValueError naming algorithm.<key> when out of range."""
    problem = _check(cfg, key)
    if problem is not None:
        raise ValueError(f"algorithm.{key}={problem[1]!r} is invalid: {problem[2]}")
    return getattr(cfg, key, _OPTIONS[key][0])


def _inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs with padding zeroed, token advantages [B, T] detached, log r_t detached and clamped
    to +-MAX_LOG_RATIO): what every loss here starts from."""
    logprobs, old_logprobs = zero_padding(logprobs, mask), zero_padding(old_logprobs, mask)
    log_ratio = (logprobs - old_logprobs).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return logprobs, _token_advantages(advantages, mask), log_ratio


def _approx_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_token_mean(-log_ratio, mask).detach()


def rec_keep_mask(ratio: torch.Tensor, adv: torch.Tensor, cfg: Any) -> torch.Tensor:
    """REC's M_t: which tokens keep their gradient, for cfg.rec_clip (bool [B, T]).

    With eps_l = clip_eps and eps_h = clip_eps_high (None: clip_eps):
      none:     every token
      one-side: A > 0 and r_t <= 1 + eps_h, or A < 0 and r_t >= 1 - eps_l (PPO's clip as a mask;
                a token with A = 0 has nothing to clip and is kept)
      two-side: 1 - eps_l <= r_t <= 1 + eps_h, whatever A's sign
      ring:     two-side, or A > 0 and r_t <= 1 - rec_ring_eps_low (a good token the policy has made
                much less likely), or A < 0 and r_t >= 1 + rec_ring_eps_high (a bad one it has made
                much more likely): the tokens whose gradient pulls them back are kept too
    """
    mode = _option(cfg, "rec_clip")
    if mode == "none":
        return torch.ones_like(ratio, dtype=torch.bool)
    eps_low = getattr(cfg, "clip_eps", 0.2)
    eps_high = getattr(cfg, "clip_eps_high", None)
    eps_high = eps_low if eps_high is None else eps_high
    if mode == "one-side":
        return torch.where(adv > 0, ratio <= 1 + eps_high, torch.where(adv < 0, ratio >= 1 - eps_low, True))
    inside = (ratio >= 1 - eps_low) & (ratio <= 1 + eps_high)
    if mode == "two-side":
        return inside
    ring_low, ring_high = _option(cfg, "rec_ring_eps_low"), _option(cfg, "rec_ring_eps_high")
    return inside | ((adv > 0) & (ratio <= 1 - ring_low)) | ((adv < 0) & (ratio >= 1 + ring_high))


@POLICY_LOSSES.register("rec", zero_at_zero_advantage=True)
def rec(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """REC, REINFORCE with clipping (Yao et al. 2025, "Group-relative REINFORCE is secretly an
    off-policy algorithm", arXiv 2509.24203; Trinity-RFT's "rec" policy loss).

    loss_t = -w_t * A * log pi_t * M_t, with w_t = sg(r_t) when rec_importance_sampling (REC-*-IS)
    and 1 otherwise (REC-*-NoIS), and M_t the mask of `rec_keep_mask` for rec_clip (none: plain
    REINFORCE). The mask only removes gradients: REC-OneSide-IS has exactly PPO's gradient, and the
    paper's finding is that REC-OneSide-NoIS, without the IS weight, trains as stably, while
    dropping the mask (none) collapses off-policy. Metrics: clipfrac (valid tokens masked out),
    approx_kl.
    """
    logprobs, adv, log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    keep = rec_keep_mask(ratio, adv, cfg)
    weight = ratio if getattr(cfg, "rec_importance_sampling", False) else torch.ones_like(ratio)
    loss = torch.where(keep, -weight * adv * logprobs, torch.zeros_like(logprobs))
    metrics = {"clipfrac": masked_token_mean((~keep).float(), mask).detach(),
               "approx_kl": _approx_kl(log_ratio, mask)}
    return _finish(loss, mask, cfg), metrics


def topr_alpha(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Any) -> torch.Tensor:
    """TOPR's weight alpha [B, T], detached: 1 where A >= 0, min(pi/mu, 1) where A < 0, with pi/mu the
    response's ratio exp(sum of its valid tokens' log r_t) (topr_ratio=sequence) or the token's r_t
    (topr_ratio=token). exp of a log-ratio capped at 0 (each token's within +-MAX_LOG_RATIO), so a
    far-off-policy response's weight underflows towards 0 and never overflows."""
    if _option(cfg, "topr_ratio") == "sequence":
        log_ratio = zero_padding(log_ratio, mask).sum(dim=-1, keepdim=True).expand(mask.shape)
    truncated = torch.exp(log_ratio.clamp(max=0.0))
    return torch.where(adv < 0, truncated, torch.ones_like(truncated)).detach()


@POLICY_LOSSES.register("topr", zero_at_zero_advantage=True)
def topr(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025, arXiv 2503.14286).

    loss_t = -sg(alpha) * A * log pi_t, alpha = 1 where A >= 0 and min(pi(y)/mu(y), 1) where A < 0
    (`topr_alpha`; mu is the sampling policy, pi(y)/mu(y) the whole response's ratio by default, as
    in the paper). Positive samples get REINFORCE's (SFT-like) gradient whatever their ratio;
    negative samples are truncated, so a negative the policy already made unlikely stops pushing
    log pi towards -inf, the divergence of off-policy REINFORCE. Metrics: clipfrac (valid tokens
    of negative samples whose weight is below 1), alpha (mean weight), approx_kl.
    """
    logprobs, adv, log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    alpha = topr_alpha(log_ratio, adv, mask, cfg)
    metrics = {"clipfrac": masked_token_mean(((adv < 0) & (alpha < 1)).float(), mask).detach(),
               "alpha": masked_token_mean(alpha, mask).detach(),
               "approx_kl": _approx_kl(log_ratio, mask)}
    return _finish(-alpha * adv * logprobs, mask, cfg), metrics


@POLICY_LOSSES.register("sppo", zero_at_zero_advantage=True)
def sppo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """sPPO, Trinity-RFT's "sppo" policy loss (its docstring cites arXiv 2108.05828): PPO's
    surrogate in log space, with a band symmetric in log r.

    loss_t = -A * log r_t * 1[1 / (1 + eps) <= r_t <= 1 + eps], eps = sppo_eps (default 0.3).
    Inside the band the gradient is REINFORCE's -A * grad log pi_t, outside it is 0 whatever A's
    sign: the gradient of REC-TwoSide-NoIS with the band [1 / (1 + eps), 1 + eps]. Unlike REC's,
    the value is 0 on policy (log r = 0), so the logged loss shows how far the update has moved.
    Metrics: clipfrac (valid tokens outside the band), approx_kl.
    """
    eps = _option(cfg, "sppo_eps")
    logprobs, adv, log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    inside = (ratio >= 1.0 / (1.0 + eps)) & (ratio <= 1.0 + eps)
    surrogate = logprobs - zero_padding(old_logprobs, mask).detach()
    loss = torch.where(inside, -adv * surrogate, torch.zeros_like(surrogate))
    metrics = {"clipfrac": masked_token_mean((~inside).float(), mask).detach(),
               "approx_kl": _approx_kl(log_ratio, mask)}
    return _finish(loss, mask, cfg), metrics


def sapo_gate(ratio: torch.Tensor, adv: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's soft gate f(r) = (4 / tau) * sigmoid(tau * (r - 1)) and the temperature tau [B, T]
    (sapo_tau_pos where A > 0, sapo_tau_neg elsewhere); differentiable in `ratio`."""
    tau_pos, tau_neg = _option(cfg, "sapo_tau_pos"), _option(cfg, "sapo_tau_neg")
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg)).detach()
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), tau


@POLICY_LOSSES.register("sapo", zero_at_zero_advantage=True)
def sapo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """SAPO, soft adaptive policy optimization (Gao et al. 2025, Qwen, arXiv 2511.20347).

    loss_t = -A * f(r_t), f(r) = (4 / tau) * sigmoid(tau * (r - 1)), tau = sapo_tau_pos (1.0) where
    A > 0 and sapo_tau_neg (1.05) elsewhere. The gradient flows through r_t, as in the paper's
    objective (and verl's compute_policy_loss_sapo): d loss_t / d log pi_t = -A * w_t with
    w_t = 4 s (1 - s) r_t, s = sigmoid(tau (r_t - 1)). On policy w = 1, GRPO's gradient; as r_t
    leaves 1 the weight decays smoothly (faster for a larger tau, so negative tokens, whose updates
    spread to many unsampled tokens, are damped sooner): a soft trust region in place of PPO's hard
    clip. Trinity-RFT (0.6.0) differs here: its loss -A * sg(f(r_t)) * log pi_t weights the gradient
    by f itself (2 / tau on policy, growing with r_t). Metrics: gate (the mean of w_t), approx_kl.
    """
    logprobs, adv, log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    differentiable = (logprobs - zero_padding(old_logprobs, mask).detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(differentiable)
    gate, tau = sapo_gate(ratio, adv, cfg)
    s = torch.sigmoid(tau * (ratio.detach() - 1.0))
    metrics = {"gate": masked_token_mean(4.0 * s * (1.0 - s) * ratio.detach(), mask).detach(),
               "approx_kl": _approx_kl(log_ratio, mask)}
    return _finish(-adv * gate, mask, cfg), metrics


@POLICY_LOSSES.register("reinforce", zero_at_zero_advantage=True)
def reinforce(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE on the sampled tokens, whatever policy sampled them: loss_t = -A * log pi_t.

    The loss of AsymRE (Arnal et al. 2025, arXiv 2506.20520), whose advantage ("asymre", below)
    puts the baseline below the group's mean reward; also REC with rec_clip=none. The old
    logprobs only feed the metric approx_kl.
    """
    logprobs, adv, log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    return _finish(-adv * logprobs, mask, cfg), {"approx_kl": _approx_kl(log_ratio, mask)}


# --- advantages -----------------------------------------------------------------------------------
# Off policy (the samples come from an older policy mu) the baseline V decides what the update
# converges to: below mu's expected reward V_mu it weighs positive samples more than negative ones,
# and AsymRE's paper proves policy improvement for V < V_mu, with collapse once V exceeds it; TOPR's
# paper shows the baseline setting the effective share of positive samples in its dataset.


@ADVANTAGES.register("asymre", per_response=True, needs_group=True)
def asymre_advantage(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """AsymRE, asymmetric REINFORCE (Arnal et al. 2025, arXiv 2506.20520; Trinity-RFT's "asymre").

    A_i = r_i - (mean of the rewards of i's group + asymre_baseline_shift). The group mean (sample
    i included) estimates V_mu; a negative shift (default -0.1, Trinity-RFT's) puts the baseline
    below it, the regime with the paper's improvement guarantee, so successes pull harder than
    failures push. Unlike GRPO no division by the std: a group whose rewards are all equal gets
    -shift (+0.1) on every sample, not 0. A group of one sample gets 0: its mean is its own reward,
    no estimate of V_mu (Trinity-RFT gives it the baseline 0, i.e. its raw reward).
    """
    rewards = _group_rewards(inputs, "asymre")
    count, total, _ = group_stats(rewards, inputs.group_ids)
    shift = float(getattr(cfg, "asymre_baseline_shift", -0.1))
    advantages = rewards - (total / count + shift)
    return _broadcast(torch.where(count > 1, advantages, torch.zeros_like(advantages)), inputs.mask)


@ADVANTAGES.register("reinforce", per_response=True)
def reinforce_advantage(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """REINFORCE with a constant baseline: A_i = r_i - reinforce_baseline (default 0, Trinity-RFT's
    "reinforce", which TOPR's preset there uses). No group statistics, so every sample keeps its
    signal, even in a group whose rewards are all equal.

    TOPR's paper trains on rewards +1 / -1 with a baseline c; for 0/1 rewards (exact_match,
    math_verify) reinforce_baseline = 0.5 gives A = +-0.5, that setting with c = 0 at half the
    scale (c in general: reinforce_baseline = (1 + c) / 2, advantages (R - c) / 2).
    """
    rewards = _group_rewards(inputs, "reinforce")
    return _broadcast(rewards - float(getattr(cfg, "reinforce_baseline", 0.0)), inputs.mask)
