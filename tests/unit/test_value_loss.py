"""PPO's clipped value loss against hand-worked numbers: the clip binding and not binding, padding
(even NaN there), a length-1 response, the gradient, and aggregation over the batch."""

import pytest
import torch

from rft.algorithms.aggregation import AGGREGATIONS
from rft.algorithms.value_loss import clipped_value_loss

NAN = float("nan")


def ref_value_loss(values, old, returns, mask, eps):
    """Plain-Python verl compute_value_loss per token (0 on padding) and the clipfrac."""
    loss, clipped_count, valid = [], 0, 0
    for v_row, o_row, r_row, m_row in zip(values, old, returns, mask):
        row = []
        for v, o, r, m in zip(v_row, o_row, r_row, m_row):
            if not m:
                row.append(0.0)
                continue
            unclipped = (v - r) ** 2
            vc = min(max(v, o - eps), o + eps)
            clipped = (vc - r) ** 2
            row.append(0.5 * max(unclipped, clipped))
            clipped_count += clipped > unclipped
            valid += 1
        loss.append(row)
    return loss, clipped_count / max(valid, 1)


def test_clip_not_binding_is_half_squared_error():
    # V moved 0.1 from V_old (inside eps 0.2): the clipped value is V itself, loss 0.5 (V - R)^2
    values = torch.tensor([[0.6, 0.3]], requires_grad=True)
    loss, metrics = clipped_value_loss(values, torch.tensor([[0.5, 0.4]]), torch.tensor([[1.0, 0.0]]),
                                       torch.ones(1, 2), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 0.16, 0.5 * 0.09]]))
    assert float(metrics["vf_clipfrac"]) == 0.0
    loss.sum().backward()  # d/dV 0.5 (V - R)^2 = V - R
    torch.testing.assert_close(values.grad, torch.tensor([[-0.4, 0.3]]))


def test_clip_binding_takes_the_larger_loss_and_blocks_the_gradient():
    # token 0: V = 1.0 moved 0.5 above V_old = 0.5 towards R = 1.2: clipped V = 0.7,
    #   (0.7 - 1.2)^2 = 0.25 > (1.0 - 1.2)^2 = 0.04 -> loss 0.125, clipped, no gradient (clamped)
    # token 1: V = 1.0 moved 0.5 above V_old = 0.5 away from R = 0.0: clipped V = 0.7,
    #   (0.7)^2 = 0.49 < 1.0 -> loss 0.5, not clipped, gradient V - R = 1.0
    values = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss, metrics = clipped_value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[1.2, 0.0]]),
                                       torch.ones(1, 2), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.5]]))
    assert float(metrics["vf_clipfrac"]) == pytest.approx(0.5)
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0]]))


def test_no_clip_is_plain_half_squared_error():
    loss, metrics = clipped_value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[3.0]]),
                                       torch.ones(1, 1), None)
    assert loss.tolist() == [[2.0]] and float(metrics["vf_clipfrac"]) == 0.0


def test_matches_reference_with_padding_nan_and_length_one_response():
    mask = [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]  # row 1: a length-1 response
    values = [[0.1, 0.9, -0.4, 2.0], [0.35, NAN, 7.0, NAN], [1.0, -1.0, NAN, 5.0]]
    old = [[0.0, 0.5, -0.3, 1.0], [0.3, 4.0, NAN, NAN], [0.5, -0.5, 3.0, NAN]]
    returns = [[1.0, 1.0, 1.0, 1.0], [-1.0, NAN, NAN, 9.0], [0.0, 2.0, NAN, NAN]]
    v = torch.tensor(values, requires_grad=True)
    loss, metrics = clipped_value_loss(v, torch.tensor(old), torch.tensor(returns),
                                       torch.tensor(mask, dtype=torch.float), 0.2)
    expected, clipfrac = ref_value_loss(values, old, returns, mask, 0.2)
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert float(metrics["vf_clipfrac"]) == pytest.approx(clipfrac)
    assert 0 < clipfrac < 1  # the case mixes binding and non-binding tokens
    loss.sum().backward()
    assert torch.isfinite(v.grad).all() and (v.grad[torch.tensor(mask) == 0] == 0).all()
    # the length-1 response: V 0.35 is 0.05 from V_old 0.3, so unclipped: 0.5 * 1.35^2
    assert loss[1, 0].item() == pytest.approx(0.5 * 1.35 ** 2)


def test_token_mean_aggregation_over_microbatches_equals_the_whole_batch():
    torch.manual_seed(0)
    values, old, returns = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float)
    agg = AGGREGATIONS.resolve("token-mean")
    whole, _ = clipped_value_loss(values, old, returns, mask, 0.2)
    total = agg(whole, mask, num_tokens=11, num_seqs=4, norm_len=5)
    parts = sum(agg(clipped_value_loss(values[s], old[s], returns[s], mask[s], 0.2)[0], mask[s],
                    num_tokens=11, num_seqs=4, norm_len=5) for s in (slice(0, 2), slice(2, 4)))
    assert total.item() == pytest.approx(parts.item())
    expected, _ = ref_value_loss(values.tolist(), old.tolist(), returns.tolist(), mask.tolist(), 0.2)
    assert total.item() == pytest.approx(sum(map(sum, expected)) / 11)


def test_bad_clip_is_refused():
    with pytest.raises(ValueError, match="value clip must be > 0"):
        clipped_value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.0)
