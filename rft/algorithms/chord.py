"""CHORD (Zhang et al., "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised
Fine-Tuning and Reinforcement Learning via Dynamic Weighting", arXiv 2508.11408; Trinity-RFT's
mix_chord): one loss over a batch that mixes the policy's own samples with expert demonstrations.

    L = (1 - mu) * L_RL(policy's samples) + mu * L_SFT(expert rows)
    L_SFT = token-mean over the expert tokens of -phi(p_t) * log p_t,   p_t = pi(y_t) (no gradient through phi)
    phi(p) = p * (1 - p)   (CHORD-phi: a token the policy already finds certain, or hopeless, teaches
                            little and disturbs the policy much; the middle ones carry the update)
             1             (chord_phi=false: plain SFT on the expert tokens)

mu follows a schedule over the stage's steps (`chord_mu`): a linear warm-up to mu_peak, then a
cosine decay to mu_valley; with no warm-up and no decay it is mu_peak throughout (CHORD-phi's
constant mu). The RL part is the algorithm's own policy loss and aggregation over the sampled
rows; the two parts are normalised separately (each by its own token or sequence counts over the
whole mini-batch), so mu is the share of the update each gets whatever the row counts.
"""

from __future__ import annotations

import math

from rft.algorithms.aggregation import zero_padding
from rft.lazy import lazy_module

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")


def chord_mu(step: int, warmup_steps: int, decay_steps: int, peak: float, valley: float) -> float:
    """mu at a stage's step (0-based): linear from 0 to `peak` over `warmup_steps`, then a cosine
    from `peak` down to `valley` over `decay_steps`, then `valley`."""
    if step < warmup_steps:
        return peak * step / warmup_steps
    if step >= warmup_steps + decay_steps:
        return valley if decay_steps else peak
    progress = (step - warmup_steps) / decay_steps
    return valley + (peak - valley) * 0.5 * (1.0 + math.cos(math.pi * progress))


def expert_token_loss(logprobs: torch.Tensor, mask: torch.Tensor, phi: bool) -> torch.Tensor:
    """Per-token -phi(p) * log p on the expert tokens (0 on padding), phi(p) = p (1 - p) detached,
    or -log p without phi."""
    logprobs = zero_padding(logprobs, mask)
    if not phi:
        return zero_padding(-logprobs, mask)
    p = logprobs.detach().exp()
    return zero_padding(-(p * (1.0 - p)) * logprobs, mask)


def check_chord(prefix: str, expert_rows: int, warmup_steps: int, decay_steps: int, peak: float,
                valley: float) -> None:
    """ValueError naming the key of an impossible CHORD setting."""
    if expert_rows < 0:
        raise ValueError(f"{prefix}algorithm.expert_rows={expert_rows} is invalid: use 0 (no expert rows) or the "
                         "number of expert demonstrations mixed into each step")
    for key, value in (("chord_mu_peak", peak), ("chord_mu_valley", valley)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{prefix}algorithm.{key}={value} is invalid: mu is the SFT part's share of the loss, "
                             "in [0, 1]")
    for key, value in (("chord_mu_warmup_steps", warmup_steps), ("chord_mu_decay_steps", decay_steps)):
        if value < 0:
            raise ValueError(f"{prefix}algorithm.{key}={value} is invalid: use 0 or more steps")
