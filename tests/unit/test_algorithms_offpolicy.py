"""The off-policy family (rft/algorithms/offpolicy.py) against its papers' formulas: each loss's
per-token value and its gradient d loss / d log pi on small fixed tensors, computed by hand or by a
plain-Python loop over tokens (math on floats), and the advantages on fixed rewards.

The same formulas are Trinity-RFT's where it implements these algorithms (REC, TOPR with
topr_ratio=token, sPPO, its "asymre", "rec", "opmd" and "reinforce" advantages), written out here:
Trinity-RFT's own functions run against ours in test_algorithms_offpolicy_trinity.py when it is
installed. Where we depart from it (SAPO's gradient, TOPR's sequence ratio, groups of one) the
test says so.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rft.algorithms.offpolicy import REC_CLIPS, option_problem
from rft.algorithms.policy_losses import POLICY_LOSSES
from rft.config import AlgorithmConfig

NAN = float("nan")
OLD = -1.0  # every old logprob; a token's logprob is then log(ratio) + OLD


def assert_close(actual: torch.Tensor, expected, tol: float = 1e-5):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def run(loss_name: str, ratios: list[list[float]], adv: list[float], mask: list[list[float]], **cfg):
    """(per-token loss, d loss.sum() / d logprobs, metrics) of loss `loss_name` where the ratios to the
    old policy are `ratios` (NaN logprobs on padding), one advantage per row."""
    logprobs = torch.log(torch.tensor(ratios)) + OLD
    mask_t = torch.tensor(mask)
    logprobs = torch.where(mask_t.bool(), logprobs, torch.tensor(NAN)).requires_grad_()
    loss, metrics = POLICY_LOSSES.get(loss_name)(logprobs, torch.full(mask_t.shape, OLD), torch.tensor(adv), mask_t,
                                            SimpleNamespace(**cfg))
    grad, = torch.autograd.grad(loss.sum(), logprobs)
    return loss, grad, metrics


def per_token(fn, ratios, adv, mask):
    """[[fn(ratio, A, log pi) or 0 on padding]]: a plain-Python reference, token by token."""
    return [[fn(r, a, math.log(r) + OLD) if m else 0.0 for r, m in zip(row, mrow)]
            for row, a, mrow in zip(ratios, adv, mask)]


# --- REC -----------------------------------------------------------------------------------------

# Ratios placed against the band [0.8, 1.2] (clip_eps 0.2) and ring's outer band [0.4, 3.0]:
#   row 0 (A = +1): 1.1 inside; 1.5 above; 0.5 below but above 0.4; 0.3 below 0.4
#   row 1 (A = -2): 0.95 inside; 0.7 below; 2.5 above but below 3.0; 3.5 above 3.0
#   row 2 (A = 0):  off-policy tokens with nothing to learn; padding holds NaN
REC_RATIOS = [[1.1, 1.5, 0.5, 0.3], [0.95, 0.7, 2.5, 3.5], [1.0, 2.0, 1.0, 1.0]]
REC_ADV = [1.0, -2.0, 0.0]
REC_MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
# which tokens keep their gradient, by hand from the comments above
REC_KEEP = {
    "none": [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]],
    "one-side": [[1, 0, 1, 1], [1, 0, 1, 1], [1, 1, 0, 0]],  # A > 0: r <= 1.2; A < 0: r >= 0.8
    "two-side": [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]],
    "ring": [[1, 0, 0, 1], [1, 0, 0, 1], [1, 0, 0, 0]],
}


@pytest.mark.parametrize("importance_sampling", [False, True])
@pytest.mark.parametrize("clip", REC_CLIPS)
def test_rec_is_reinforce_on_the_tokens_its_mask_keeps(clip, importance_sampling):
    loss, grad, metrics = run("rec", REC_RATIOS, REC_ADV, REC_MASK, clip_eps=0.2, rec_clip=clip,
                              rec_importance_sampling=importance_sampling)
    keep = REC_KEEP[clip]
    weight = (lambda r: r) if importance_sampling else (lambda r: 1.0)
    expected = [[-weight(r) * a * lp * k for lp, r, k in zip(row, rrow, krow)]
                for row, rrow, a, krow in zip(per_token(lambda r, a, lp: lp, REC_RATIOS, REC_ADV, REC_MASK),
                                              REC_RATIOS, REC_ADV, keep)]
    assert_close(loss, expected)
    # d/d log pi of -w A log pi with w stopped: -w A where kept, 0 elsewhere (and on padding)
    assert_close(grad, [[-weight(r) * a * k for r, k in zip(rrow, krow)]
                        for rrow, a, krow in zip(REC_RATIOS, REC_ADV, keep)])
    dropped = sum(m - k for mrow, krow in zip(REC_MASK, keep) for m, k in zip(mrow, krow))
    assert metrics["clipfrac"].item() == pytest.approx(dropped / 10)


def test_rec_one_side_with_importance_sampling_has_ppos_gradient():
    """REC-OneSide-IS drops what PPO's clip drops and weights the rest by the ratio: the same
    gradient as PPO's clipped surrogate (the paper's reading of GRPO), from a different value."""
    cfg = dict(clip_eps=0.2, clip_eps_high=0.28)
    _, rec_grad, _ = run("rec", REC_RATIOS, REC_ADV, REC_MASK, rec_clip="one-side", rec_importance_sampling=True, **cfg)
    _, ppo_grad, _ = run("ppo", REC_RATIOS, REC_ADV, REC_MASK, **cfg)
    torch.testing.assert_close(rec_grad, ppo_grad)
    assert (rec_grad != 0).sum() == 6  # it is not trivially zero: three tokens a row of A != 0


def test_rec_clip_eps_high_moves_the_upper_bound_only():
    _, grad, _ = run("rec", [[1.25, 0.75]], [1.0], [[1, 1]], clip_eps=0.2, clip_eps_high=0.28, rec_clip="two-side")
    assert_close(grad, [[-1.0, 0.0]])  # 1.25 <= 1.28 kept, 0.75 < 0.8 dropped


# --- TOPR ----------------------------------------------------------------------------------------

# row 0 (A = +1): a positive far off policy, never truncated
# row 1 (A = -1): response ratio 0.5 * 0.8 = 0.4 < 1
# row 2 (A = -1): response ratio 2 * 1.5 = 3 > 1: weight 1
# row 3 (A = -1): response ratio 2 * 0.25 = 0.5, one token above 1; the padding slot holds NaN
TOPR_RATIOS = [[0.5, 0.2, 1.0], [0.5, 0.8, 1.0], [2.0, 1.5, 1.0], [2.0, 0.25, 1.0]]
TOPR_ADV = [1.0, -1.0, -1.0, -1.0]
TOPR_MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]]
# alpha by hand: 1 for A >= 0, min(pi/mu, 1) for A < 0
TOPR_ALPHA = {"sequence": [[1, 1, 1], [0.4, 0.4, 0.4], [1, 1, 1], [0.5, 0.5, 0]],
              "token": [[1, 1, 1], [0.5, 0.8, 1], [1, 1, 1], [1, 0.25, 0]]}


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_topr_truncates_negative_samples_only(level):
    loss, grad, metrics = run("topr", TOPR_RATIOS, TOPR_ADV, TOPR_MASK, topr_ratio=level)
    alpha = TOPR_ALPHA[level]
    log_pi = per_token(lambda r, a, lp: lp, TOPR_RATIOS, TOPR_ADV, TOPR_MASK)
    assert_close(loss, [[-al * a * lp for al, lp in zip(arow, lrow)] for arow, lrow, a in zip(alpha, log_pi, TOPR_ADV)])
    # the gradient is -sg(alpha) A: alpha is not differentiated
    assert_close(grad, [[-al * a for al in arow] for arow, a in zip(alpha, TOPR_ADV)])
    valid = [al for arow, mrow in zip(alpha, TOPR_MASK) for al, m in zip(arow, mrow) if m]
    assert metrics["alpha"].item() == pytest.approx(sum(valid) / len(valid))
    truncated = {"sequence": 3 + 2, "token": 2 + 1}[level]  # negative tokens with alpha < 1
    assert metrics["clipfrac"].item() == pytest.approx(truncated / len(valid))


def test_topr_defaults_to_the_papers_sequence_ratio():
    loss, _, _ = run("topr", TOPR_RATIOS, TOPR_ADV, TOPR_MASK)
    expected, _, _ = run("topr", TOPR_RATIOS, TOPR_ADV, TOPR_MASK, topr_ratio="sequence")
    torch.testing.assert_close(loss, expected)


def test_topr_stops_pushing_a_negative_the_policy_already_made_unlikely():
    """REINFORCE keeps pushing log pi of a negative sample towards -inf (gradient -A whatever pi);
    TOPR's weight min(pi/mu, 1) fades with pi, and a response off by e^-1000 gets ~0 (each token's
    log-ratio is capped at -20, as PPO's), not NaN."""
    for log_ratio, weight in ((math.log(1e-3), 1e-3), (-1000.0, 0.0)):
        logprobs = torch.tensor([[log_ratio / 2 + OLD, log_ratio / 2 + OLD]], requires_grad=True)
        for name, expected in (("topr", weight), ("reinforce", 1.0)):
            loss, _ = POLICY_LOSSES.get(name)(logprobs, torch.full((1, 2), OLD), torch.tensor([-1.0]),
                                              torch.ones(1, 2), None)
            grad, = torch.autograd.grad(loss.sum(), logprobs)
            assert torch.isfinite(loss).all()
            assert_close(grad, [[expected, expected]], tol=1e-9)


# --- sPPO ----------------------------------------------------------------------------------------

# the band for eps = 0.3 is [1/1.3, 1.3] = [0.76923, 1.3]
SPPO_RATIOS = [[1.25, 1.35, 0.78, 0.75], [1.29, 0.5, 0.77, 1.0]]
SPPO_ADV = [1.0, -2.0]
SPPO_MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
SPPO_INSIDE = [[1, 0, 1, 0], [1, 0, 1, 0]]


def test_sppo_is_the_log_ratio_surrogate_inside_a_log_symmetric_band():
    loss, grad, metrics = run("sppo", SPPO_RATIOS, SPPO_ADV, SPPO_MASK, sppo_eps=0.3)
    assert_close(loss, [[-a * math.log(r) * k for r, k in zip(rrow, krow)]
                        for rrow, a, krow in zip(SPPO_RATIOS, SPPO_ADV, SPPO_INSIDE)])
    assert_close(grad, [[-a * k for k in krow] for a, krow in zip(SPPO_ADV, SPPO_INSIDE)])
    assert metrics["clipfrac"].item() == pytest.approx(3 / 7)  # 1.35, 0.75 and 0.5 of 7 valid tokens
    # the default eps is Trinity-RFT's 0.3
    default, _, _ = run("sppo", SPPO_RATIOS, SPPO_ADV, SPPO_MASK)
    torch.testing.assert_close(default, loss)


def test_sppo_has_the_gradient_of_rec_two_side_without_importance_sampling():
    _, sppo_grad, _ = run("sppo", SPPO_RATIOS, SPPO_ADV, SPPO_MASK, sppo_eps=0.3)
    _, rec_grad, _ = run("rec", SPPO_RATIOS, SPPO_ADV, SPPO_MASK, rec_clip="two-side",
                         clip_eps=1 - 1 / 1.3, clip_eps_high=0.3)
    torch.testing.assert_close(sppo_grad, rec_grad)


# --- SAPO ----------------------------------------------------------------------------------------

SAPO_RATIOS = [[1.0, 1.25, 10.0, 0.5], [1.0, 1.25, 10.0, 0.5], [1.0, 2.0, 1.0, 1.0]]
SAPO_ADV = [1.5, -1.5, 0.0]
SAPO_MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def sapo_tau(a: float) -> float:
    return 1.0 if a > 0 else 1.05


def test_sapo_value_is_the_soft_gate_times_the_advantage():
    loss, _, _ = run("sapo", SAPO_RATIOS, SAPO_ADV, SAPO_MASK)
    gate = lambda r, a, lp: -a * 4 / sapo_tau(a) * sigmoid(sapo_tau(a) * (r - 1))  # noqa: E731
    assert_close(loss, per_token(gate, SAPO_RATIOS, SAPO_ADV, SAPO_MASK))


def test_sapo_gradient_is_the_papers_soft_trust_region():
    """d(-A f(r)) / d log pi = -A f'(r) r = -A 4 s (1 - s) r with s = sigmoid(tau (r - 1)): 1 on
    policy (GRPO's gradient), smaller the further r is from 1, and smaller for A < 0 (tau_neg > tau_pos)."""
    _, grad, metrics = run("sapo", SAPO_RATIOS, SAPO_ADV, SAPO_MASK)

    def weight(r: float, a: float) -> float:
        s = sigmoid(sapo_tau(a) * (r - 1))
        return 4 * s * (1 - s) * r

    assert_close(grad, per_token(lambda r, a, lp: -a * weight(r, a), SAPO_RATIOS, SAPO_ADV, SAPO_MASK))
    # on policy: exactly REINFORCE's -A
    assert grad[0, 0].item() == pytest.approx(-1.5) and grad[1, 0].item() == pytest.approx(1.5)
    # no hard edge like PPO's clip at 1.2: at r = 1.25 the weight is 1.23 (the factor r), at r = 0.5
    # 0.47; far off policy the gate has closed (r = 10: 0.005)
    assert weight(1.25, 1.5) == pytest.approx(1.2307, abs=1e-4) and weight(0.5, 1.5) == pytest.approx(0.4700, abs=1e-4)
    assert abs(grad[0, 2].item()) < 0.01 * 1.5
    assert abs(grad[1, 1].item()) < abs(grad[0, 1].item())  # tau_neg damps negative tokens sooner
    valid = [weight(r, a) for row, a, mrow in zip(SAPO_RATIOS, SAPO_ADV, SAPO_MASK) for r, m in zip(row, mrow) if m]
    assert metrics["gate"].item() == pytest.approx(sum(valid) / len(valid))


def test_sapo_gradient_matches_finite_differences_of_its_objective():
    """Autograd of the loss against central differences of sum_t -A f(r_t) in each log pi_t."""
    ratios, adv, mask = [[1.3, 0.6, 2.2]], [-0.7], [[1, 1, 1]]
    _, grad, _ = run("sapo", ratios, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    h = 1e-6
    for t, r in enumerate(ratios[0]):
        f = lambda lr: -adv[0] * 4 / 2.0 * sigmoid(2.0 * (math.exp(lr) - 1))  # noqa: E731
        numeric = (f(math.log(r) + h) - f(math.log(r) - h)) / (2 * h)
        assert grad[0, t].item() == pytest.approx(numeric, rel=1e-4)


# --- REINFORCE, shared properties ---------------------------------------------------------------

def test_reinforce_is_minus_advantage_times_logprob():
    loss, grad, _ = run("reinforce", REC_RATIOS, REC_ADV, REC_MASK)
    assert_close(loss, per_token(lambda r, a, lp: -a * lp, REC_RATIOS, REC_ADV, REC_MASK))
    assert_close(grad, [[-a * m for m in mrow] for a, mrow in zip(REC_ADV, REC_MASK)])
    rec_none, _, _ = run("rec", REC_RATIOS, REC_ADV, REC_MASK, rec_clip="none")
    torch.testing.assert_close(loss, rec_none)


OFF_POLICY_LOSSES = ["rec", "topr", "sppo", "sapo", "reinforce"]


@pytest.mark.parametrize("name", OFF_POLICY_LOSSES)
def test_zero_advantage_rows_have_zero_loss_and_gradient(name):
    """What `zero_at_zero_advantage` promises the trainer (it leaves such rows out)."""
    assert POLICY_LOSSES.meta(POLICY_LOSSES.get(name))["zero_at_zero_advantage"] is True
    loss, grad, _ = run(name, REC_RATIOS, REC_ADV, REC_MASK)
    assert (loss[2] == 0).all() and (grad[2] == 0).all()
    assert (loss[0] != 0).any() and (grad[0] != 0).any()  # the other rows do learn


@pytest.mark.parametrize("name", OFF_POLICY_LOSSES)
def test_is_weights_multiply_the_per_token_loss(name):
    weights = torch.tensor([[2.0, 0.5, 1.0, 3.0], [1.0, 1.0, 0.0, 2.0], [1.0, 1.0, NAN, NAN]])
    plain, _, _ = run(name, REC_RATIOS, REC_ADV, REC_MASK)
    weighted, _, _ = run(name, REC_RATIOS, REC_ADV, REC_MASK, is_weights=weights)
    torch.testing.assert_close(weighted, plain * torch.nan_to_num(weights) * torch.tensor(REC_MASK))


@pytest.mark.parametrize("key, value, message", [
    ("rec_clip", "both", "algorithm.rec_clip='both' is invalid: use one of none, one-side, two-side, ring"),
    ("rec_ring_eps_low", 1.5, "algorithm.rec_ring_eps_low=1.5 is invalid: use a value in (0, 1]"),
    ("rec_ring_eps_high", 0.0, "algorithm.rec_ring_eps_high=0.0 is invalid: use a positive value"),
    ("topr_ratio", "response", "algorithm.topr_ratio='response' is invalid: use one of sequence, token"),
    ("sppo_eps", -0.3, "algorithm.sppo_eps=-0.3 is invalid: use a positive value"),
    ("sapo_tau_pos", 0.0, "algorithm.sapo_tau_pos=0.0 is invalid: use a positive temperature"),
    ("sapo_tau_neg", -1.05, "algorithm.sapo_tau_neg=-1.05 is invalid: use a positive temperature"),
])
def test_out_of_range_options_name_the_key_and_a_fix(key, value, message):
    loss = {"rec": "rec", "top": "topr", "spp": "sppo", "sap": "sapo"}[key[:3]]
    cfg = {"rec_clip": "ring"} if key.startswith("rec_ring") else {}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        run(loss, REC_RATIOS, REC_ADV, REC_MASK, **cfg, **{key: value})
    assert option_problem(SimpleNamespace(**{key: value}))[:2] == (key, value)


def test_config_defaults_are_the_losses_defaults():
    """AlgorithmConfig's defaults and the losses' fallbacks (cfg without the key) agree."""
    cfg = AlgorithmConfig()
    assert option_problem(cfg) is None
    for name in OFF_POLICY_LOSSES:
        from_config, _, _ = run(name, REC_RATIOS, REC_ADV, REC_MASK, **vars(cfg))
        bare, _, _ = run(name, REC_RATIOS, REC_ADV, REC_MASK)
        torch.testing.assert_close(from_config, bare)


# --- advantages -----------------------------------------------------------------------------------

# group 0: rewards 1, 0, 0, 1 (mean 0.5); group 1: one sample; group 2: all equal (mean 1)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 2, 2])
ADV_MASK = torch.tensor([[1.0, 1.0, 0.0]] * 7)


def advantages(name: str, **cfg) -> torch.Tensor:
    out = ADVANTAGES.get(name)(AdvantageInputs(REWARDS, GROUPS, ADV_MASK), SimpleNamespace(**cfg))
    assert (out.advantages[:, 2] == 0).all() and out.returns is None  # padding gets nothing
    assert torch.equal(out.advantages[:, 0], out.advantages[:, 1])  # one value per response
    return out.advantages[:, 0]


def test_asymre_lowers_the_group_baseline():
    # baseline = group mean - 0.1: group 0 at 0.4, group 2 at 0.9; a group of one gets 0
    assert_close(advantages("asymre"), [0.6, -0.4, -0.4, 0.6, 0.0, 0.1, 0.1])
    assert_close(advantages("asymre", asymre_baseline_shift=-0.3), [0.8, -0.2, -0.2, 0.8, 0.0, 0.3, 0.3])
    # shift 0 is reward - group mean, dr_grpo's advantage
    torch.testing.assert_close(advantages("asymre", asymre_baseline_shift=0.0), advantages("dr_grpo"))


def test_reinforce_subtracts_a_constant():
    assert_close(advantages("reinforce"), REWARDS.tolist())
    assert_close(advantages("reinforce", reinforce_baseline=0.5), [0.5, -0.5, -0.5, 0.5, 0.0, 0.5, 0.5])


def test_the_new_advantages_declare_what_data_they_need():
    meta = {name: ADVANTAGES.meta(ADVANTAGES.get(name)) for name in ("asymre", "reinforce")}
    assert meta["asymre"] == {"per_response": True, "needs_group": True}
    assert meta["reinforce"] == {"per_response": True}
