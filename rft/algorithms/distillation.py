"""On-policy distillation: the student samples, a frozen teacher scores the same tokens, and each
sampled token's advantage says how much more (or less) likely the teacher found it.

    on_policy_distill   A_t = -distill_coef * (log pi_s(y_t) - log pi_t(y_t))
    jsd                 A_t = -distill_coef * (1 - beta) * (log pi_s(y_t) - log m(y_t)),
                        m = beta * pi_t + (1 - beta) * pi_s on the sampled token

log pi_s is the student's logprob when it sampled (vLLM's, the experience's `logprobs`), log pi_t
the teacher's (`teacher_logprobs`, written by the explorer from the judge engine: rft/explorer/
teacher.py). Registered with `needs_teacher=True`: the trainer passes both as
AdvantageInputs.old_logprobs / teacher_logprobs, and the explorer asks the teacher for every row.

Why an advantage and not a loss. The teacher scores only the sampled token (no vocabulary-wide
logits cross the network). On those tokens, the per-token reverse KL's sample estimate
log pi_s(y) - log pi_t(y) has the gradient grad log pi_s(y), whose expectation under pi_s is 0: as
a loss it teaches nothing. As a (stop-gradient) per-token reward under the policy gradient,
E[-(log pi_s - log pi_t) * grad log pi_s] is exactly minus the gradient of KL(pi_s || pi_t) per
position (the score-function estimator), so the usual policy losses (ppo, cispo, ...) minimise
the reverse KL, with their clipping and importance weights for rows sampled off-policy.

The generalised Jensen-Shannon divergence JSD_beta = beta KL(pi_t || m) + (1 - beta) KL(pi_s || m)
has, by the same argument, the gradient (1 - beta) E_{y ~ pi_s}[grad log pi_s(y) log(pi_s(y) / m(y))]
(the terms through m cancel), hence `jsd`'s advantage. Trinity-RFT's "jsd" advantage is instead
minus the divergence's sampled-token VALUE, beta p_t log(p_t / m) + (1 - beta) p_s log(p_s / m),
which is positive whether the teacher likes the token more or less than the student, so it pushes
every token down in proportion to the disagreement; rft follows the gradient (tests/unit/
test_distillation.py checks both estimators' expectation against autograd on a full vocabulary).

No discount: each token is credited only with its own divergence (discount 0), as Thinking Machines'
on-policy distillation and Trinity-RFT do. No group baseline: the teacher's logprob already is a
dense, per-token signal.

Rows the teacher did not score (it timed out: teacher/failures in the rollout metrics) get
advantage 0: they are in the batch and take no gradient.
"""

from __future__ import annotations

import math
from typing import Any

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutputs, _check_inputs
from rft.algorithms.aggregation import zero_padding
from rft.lazy import lazy_module

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")


def _teacher_inputs(inputs: AdvantageInputs, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student logprobs, teacher logprobs, mask with the unscored rows taken out), all [B, T]."""
    _check_inputs(inputs, name)
    if inputs.old_logprobs is None or inputs.teacher_logprobs is None:
        raise ValueError(f"{name} needs the student's sampling logprobs and the teacher's (AdvantageInputs."
                         "old_logprobs / teacher_logprobs [B, T]): the explorer writes the teacher's when a "
                         "judge engine serves the teacher (cluster.judge_ranks=1, judge.model=<teacher>)")
    scored = inputs.teacher_scored if inputs.teacher_scored is not None else torch.ones(inputs.mask.shape[0])
    mask = inputs.mask * scored.reshape(-1, 1).to(inputs.mask.dtype)
    return inputs.old_logprobs.detach().float(), inputs.teacher_logprobs.detach().float(), mask


def reverse_kl_per_token(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_s - log pi_t on the sampled tokens (0 on padding): the reverse KL's sample estimate."""
    return zero_padding(student - teacher, mask)


def jsd_log_ratio(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """log pi_s - log m on the sampled tokens, m = beta * pi_t + (1 - beta) * pi_s (0 on padding);
    beta in (0, 1)."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"algorithm.jsd_beta must lie strictly between 0 and 1 (got {beta}); 0.5 is the "
                         "symmetric Jensen-Shannon divergence")
    student, teacher = zero_padding(student, mask), zero_padding(teacher, mask)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), dim=0)
    return zero_padding(student - mixture, mask)


@ADVANTAGES.register("on_policy_distill", needs_teacher=True)
def on_policy_distill(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """A_t = -distill_coef * (log pi_s(y_t) - log pi_t(y_t)): the student's sampled tokens that the
    teacher finds likelier than the student did are reinforced, the others pushed down."""
    student, teacher, mask = _teacher_inputs(inputs, "on_policy_distill")
    coef = getattr(cfg, "distill_coef", 1.0)
    return AdvantageOutputs(advantages=-coef * reverse_kl_per_token(student, teacher, mask))


@ADVANTAGES.register("jsd", needs_teacher=True)
def jsd(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """A_t = -distill_coef * (1 - beta) * (log pi_s(y_t) - log m(y_t)), beta = cfg.jsd_beta (0.5:
    the symmetric JSD): minus the JSD's per-token gradient weight (module docstring)."""
    student, teacher, mask = _teacher_inputs(inputs, "jsd")
    coef, beta = getattr(cfg, "distill_coef", 1.0), getattr(cfg, "jsd_beta", 0.5)
    return AdvantageOutputs(advantages=-coef * (1.0 - beta) * jsd_log_ratio(student, teacher, mask, beta))
