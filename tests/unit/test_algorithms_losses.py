"""Policy losses, truncated IS weights, DPO and KL estimators against plain-Python references
(math on floats, loops over tokens) and hand computations."""

import math
from types import SimpleNamespace

import pytest
import torch

from rft.algorithms.kl import KL_ESTIMATORS, kl_penalty_rewards
from rft.algorithms.policy_losses import POLICY_LOSSES, dpo_loss, truncated_is_weights

NAN, INF = float("nan"), float("inf")


def assert_close(actual: torch.Tensor, expected, tol: float = 1e-5):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=tol, rtol=0)


def call(name, logprobs, old, adv, mask, **cfg):
    return POLICY_LOSSES.get(name)(logprobs, old, adv, mask, SimpleNamespace(**cfg))


# --- PPO ----------------------------------------------------------------------------------------

def ref_ppo_token(ratio: float, adv: float, low: float, high: float, dual_c: float | None) -> float:
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    if dual_c is not None and adv < 0:
        loss = min(loss, -adv * dual_c)
    return loss


# ratios chosen so each bound binds somewhere:
#   row 0 (A = +1): 1.25 is inside the clip-higher bound 1.28 but outside a symmetric 1.2;
#                   1.5 is clipped at 1.28; 0.5 is below 0.8 but A > 0 keeps it unclipped
#   row 1 (A = -2): 0.7 is clipped at 0.8; 5.0 is unclipped by PPO and capped by dual-clip c = 3;
#                   the last slot is padding holding NaN
RATIOS = [[1.25, 1.5, 0.5], [0.7, 5.0, 1.0]]
ADV = [1.0, -2.0]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def ppo_inputs():
    logprobs = torch.log(torch.tensor(RATIOS)) - 1.0  # old logprobs are all -1
    logprobs[1, 2] = NAN
    return logprobs.requires_grad_(), torch.full((2, 3), -1.0), torch.tensor(ADV)


@pytest.mark.parametrize("clip_eps_high,dual_clip_c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_matches_reference(clip_eps_high, dual_clip_c):
    logprobs, old, adv = ppo_inputs()
    loss, _ = call("ppo", logprobs, old, adv, MASK, clip_eps=0.2, clip_eps_high=clip_eps_high,
                   dual_clip_c=dual_clip_c)
    high = 0.2 if clip_eps_high is None else clip_eps_high
    expected = [[ref_ppo_token(r, a, 0.2, high, dual_clip_c) if m else 0.0 for r, m in zip(row, mrow)]
                for row, a, mrow in zip(RATIOS, ADV, MASK.tolist())]
    assert_close(loss, expected)
    loss.sum().backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[1, 2] == 0


def test_ppo_clip_higher_and_dual_clip_bind_where_expected():
    logprobs, old, adv = ppo_inputs()
    loss, metrics = call("ppo", logprobs, old, adv, MASK, clip_eps=0.2, clip_eps_high=0.28, dual_clip_c=3.0)
    # row 0: -1.25 (inside 1.28), -1.28 (clipped), -0.5; row 1: 2 * 0.8 = 1.6 (clipped), 2 * 3 = 6 (dual)
    assert_close(loss, [[-1.25, -1.28, -0.5], [1.6, 6.0, 0.0]])
    # clipped tokens: 1.5 (row 0) and 0.7 (row 1) of 5 valid tokens; dual-clip binds on 1 of 5
    assert metrics["clipfrac"].item() == pytest.approx(2 / 5)
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 5)
    loss.sum().backward()
    # d(-A * r)/d log r = -A * r where unclipped; 0 where a clip or the dual-clip binds
    assert_close(logprobs.grad, [[-1.25, 0.0, -0.5], [0.0, 0.0, 0.0]])


def test_ppo_symmetric_clip_binds_on_1_25():
    logprobs, old, adv = ppo_inputs()
    loss, metrics = call("ppo", logprobs, old, adv, MASK, clip_eps=0.2)
    assert loss[0, 0].item() == pytest.approx(-1.2)
    assert metrics["clipfrac"].item() == pytest.approx(3 / 5)


def test_ppo_accepts_one_advantage_per_response():
    logprobs, old, adv = ppo_inputs()
    per_response, _ = call("ppo", logprobs, old, adv, MASK)
    per_token, _ = call("ppo", logprobs, old, adv.unsqueeze(1).expand(2, 3), MASK)
    assert torch.equal(per_response, per_token)


def test_ppo_rejects_dual_clip_not_above_one():
    logprobs, old, adv = ppo_inputs()
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        call("ppo", logprobs, old, adv, MASK, dual_clip_c=0.5)


def test_is_weights_multiply_the_per_token_loss():
    logprobs, old, adv = ppo_inputs()
    plain, _ = call("ppo", logprobs, old, adv, MASK)
    weights = torch.tensor([[0.5, 2.0, 1.0], [0.0, 1.0, NAN]])
    weighted, _ = call("ppo", logprobs, old, adv, MASK, is_weights=weights)
    assert_close(weighted, (plain * torch.nan_to_num(weights)).tolist())


# --- GSPO ---------------------------------------------------------------------------------------

def ref_seq_ratio(logprobs: list[float], old: list[float], length: int) -> float:
    return math.exp(sum(lp - o for lp, o in zip(logprobs[:length], old[:length])) / length)


GSPO_LP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
GSPO_OLD = [[-1.1, -0.4, -2.3], [-0.5, -1.0, 0.0]]
GSPO_LENGTHS = [3, 1]
GSPO_ADV = [1.5, -0.5]


def gspo_mask():
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(3)] for n in GSPO_LENGTHS])


def test_gspo_token_value_is_the_sequence_ratio():
    logprobs = torch.tensor(GSPO_LP, requires_grad=True)
    loss, _ = call("gspo", logprobs, torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), gspo_mask(),
                   clip_eps=10.0)  # wide enough that no clip binds
    expected = []
    for i, n in enumerate(GSPO_LENGTHS):
        s = ref_seq_ratio(GSPO_LP[i], GSPO_OLD[i], n)
        expected.append([-GSPO_ADV[i] * s if t < n else 0.0 for t in range(3)])
    assert_close(loss, expected)


def test_gspo_gradient_matches_finite_differences_of_the_sequence_objective():
    """Summed over a sequence's tokens, GSPO-token's gradient is that of -A * |y| * s(logprobs)."""
    logprobs = torch.tensor(GSPO_LP, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(GSPO_OLD, dtype=torch.float64)
    loss, _ = call("gspo", logprobs, old, torch.tensor(GSPO_ADV, dtype=torch.float64), gspo_mask(),
                   clip_eps=10.0)
    loss.sum().backward()

    def objective(lp: list[list[float]]) -> float:
        return sum(-GSPO_ADV[i] * n * ref_seq_ratio(lp[i], GSPO_OLD[i], n) for i, n in enumerate(GSPO_LENGTHS))

    h = 1e-6
    for i in range(2):
        for t in range(3):
            up = [row[:] for row in GSPO_LP]
            down = [row[:] for row in GSPO_LP]
            up[i][t] += h
            down[i][t] -= h
            numeric = (objective(up) - objective(down)) / (2 * h)
            assert logprobs.grad[i, t].item() == pytest.approx(numeric, abs=1e-6)
            # analytical form: -A_i * s_i on valid tokens, 0 on padding
            analytic = -GSPO_ADV[i] * ref_seq_ratio(GSPO_LP[i], GSPO_OLD[i], GSPO_LENGTHS[i])
            assert logprobs.grad[i, t].item() == pytest.approx(analytic if t < GSPO_LENGTHS[i] else 0.0)


def test_gspo_clips_whole_sequences():
    # row 0: s = exp(mean(0.1, -0.1, 0.3)) = exp(0.1) = 1.105 > 1 + 0.05 with A > 0 -> clipped
    logprobs = torch.tensor(GSPO_LP, requires_grad=True)
    loss, metrics = call("gspo", logprobs, torch.tensor(GSPO_OLD), torch.tensor(GSPO_ADV), gspo_mask(),
                         clip_eps=0.05)
    assert_close(loss[0], [-1.5 * 1.05] * 3)
    # row 1: s = exp(0.2) = 1.221, A < 0: max(0.5 * 1.221, 0.5 * 1.05) keeps the unclipped value
    assert loss[1, 0].item() == pytest.approx(0.5 * math.exp(0.2), rel=1e-6)
    assert metrics["clipfrac"].item() == pytest.approx(3 / 4)
    loss.sum().backward()
    assert (logprobs.grad[0] == 0).all()


# --- CISPO and SFT ------------------------------------------------------------------------------

@pytest.mark.parametrize("clip_low", [None, 0.5])
def test_cispo_matches_reference_and_gradient_skips_the_weight(clip_low):
    ratios = [[3.0, 0.2, 1.1], [1.0, 9.0, 1.0]]
    adv = [2.0, -1.0]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.full((2, 3), -2.0)
    logprobs = (torch.log(torch.tensor(ratios)) - 2.0).requires_grad_()
    loss, metrics = call("cispo", logprobs, old, torch.tensor(adv), mask, cispo_clip_high=1.0,
                         cispo_clip_low=clip_low)

    def weight(r: float) -> float:
        return min(r, 2.0) if clip_low is None else min(max(r, 1 - clip_low), 2.0)

    lp = logprobs.detach().tolist()
    expected = [[-weight(r) * a * lp[i][t] * m for t, (r, m) in enumerate(zip(row, mrow))]
                for i, (row, a, mrow) in enumerate(zip(ratios, adv, mask.tolist()))]
    assert_close(loss, expected)
    loss.sum().backward()
    # the weight is a constant: d loss / d logprob = -w * A, even where the weight is unclipped
    expected_grad = [[-weight(r) * a * m for r, m in zip(row, mrow)]
                     for row, a, mrow in zip(ratios, adv, mask.tolist())]
    assert_close(logprobs.grad, expected_grad)
    clipped = 2 if clip_low is None else 3  # 3.0 and 9.0 above 2; 0.2 below 0.5 when bounded
    assert metrics["clipfrac"].item() == pytest.approx(clipped / 5)


def test_sft_is_masked_negative_log_likelihood():
    logprobs = torch.tensor([[-0.5, -1.5, -INF]], requires_grad=True)
    loss, metrics = call("sft", logprobs, torch.zeros(1, 3), torch.zeros(1), torch.tensor([[1.0, 1.0, 0.0]]))
    assert_close(loss, [[0.5, 1.5, 0.0]])
    assert metrics == {}
    loss.sum().backward()
    assert_close(logprobs.grad, [[-1.0, -1.0, 0.0]])


# --- truncated importance sampling --------------------------------------------------------------

def test_truncated_is_weights_cap_detach_and_masked_tokens():
    trainer = torch.tensor([[-1.0, -0.5, -3.0, -INF]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -2.5, -1.0, -INF]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(trainer, rollout, cap=2.0, mask=mask)
    # exp(0.5) = 1.6487; exp(2.0) = 7.39 -> capped at 2; exp(-2) = 0.1353; padding -> 0
    assert_close(w, [[math.exp(0.5), 2.0, math.exp(-2.0), 0.0]])
    assert not w.requires_grad


def test_truncated_is_weights_without_mask_are_finite_on_undefined_ratios():
    w = truncated_is_weights(torch.tensor([-INF, 0.0, NAN]), torch.tensor([-INF, -INF, 0.0]), cap=3.0)
    assert_close(w, [0.0, 3.0, 0.0])
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(torch.zeros(1), torch.zeros(1), cap=0.0)


# --- DPO ----------------------------------------------------------------------------------------

def test_dpo_by_hand():
    beta = 0.5
    # pair 0: chosen reward 0.5 * (-1 + 2) = 0.5, rejected 0.5 * (-3 + 2) = -0.5, margin 1
    # pair 1: chosen 0.5 * (-2 + 1.5) = -0.25, rejected 0.5 * (-1 + 1.5) = 0.25, margin -0.5
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, metrics = dpo_loss(chosen, torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -1.5]),
                             torch.tensor([-2.0, -1.5]), beta)
    # -log sigmoid(m) = log(1 + exp(-m))
    assert_close(loss, [math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.5))])
    assert metrics["rewards/accuracy"].item() == 0.5
    assert metrics["rewards/margin"].item() == pytest.approx(0.25)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.125)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.125)
    loss.sum().backward()
    # d/dc -log sigmoid(beta * (c - ...)) = -beta * sigmoid(-m)
    assert_close(chosen.grad, [-beta / (1 + math.exp(1.0)), -beta / (1 + math.exp(-0.5))])


# --- KL -----------------------------------------------------------------------------------------

LOGP = [-1.0, -2.0, -0.5, 0.0]
REF = [-1.0, -1.5, -0.9, -0.2]


@pytest.mark.parametrize("name,formula", [
    ("k1", lambda d: d),
    ("k2", lambda d: 0.5 * d * d),
    ("k3", lambda d: math.exp(-d) + d - 1),
    ("low_var_kl", lambda d: math.exp(-d) + d - 1),  # no clamp binds on these values
])
def test_kl_estimators_match_formulas(name, formula):
    kl = KL_ESTIMATORS.get(name)(torch.tensor(LOGP), torch.tensor(REF))
    assert_close(kl, [formula(lp - r) for lp, r in zip(LOGP, REF)])


def test_low_var_kl_clamps_extreme_tokens():
    kl = KL_ESTIMATORS.get("low_var_kl")(torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0]))
    # r = -30 -> clamped -20: e^-20 + 20 - 1 = 19 -> clamped 10; r = 30 -> e^20 - 21 -> clamped 10
    assert_close(kl, [10.0, 10.0])


def test_kl_penalty_rewards_by_name_or_function_and_masked():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, NAN]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -INF]])
    by_name = kl_penalty_rewards(logp, ref, mask, "k2", coef=0.2)
    # -0.2 * 0.5 * d^2 with d = 0.5, -1
    assert_close(by_name, [[-0.025, -0.1, 0.0]])
    assert not by_name.requires_grad
    by_fn = kl_penalty_rewards(logp, ref, mask, KL_ESTIMATORS.get("k2"), coef=0.2)
    assert torch.equal(by_fn, by_name)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        kl_penalty_rewards(logp, ref, mask, "k9", coef=0.2)
