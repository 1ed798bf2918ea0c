"""Loss aggregations (against plain loops, and the partition contract: pieces of a batch sum to the
full-batch value and gradient) and sample filters."""

import pytest
import torch

from rft.algorithms.aggregation import AGGREGATIONS, batch_counts
from rft.algorithms.filters import SAMPLE_FILTERS

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_LEN = 8


def ref_aggregate(mode: str, per_token: list[list[float]], mask: list[list[float]], norm_len: int) -> float:
    """Full-batch value by plain loops; fully masked sequences do not count as sequences."""
    seqs = [[v for v, m in zip(row, mrow) if m] for row, mrow in zip(per_token, mask)]
    seqs = [s for s in seqs if s]
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    return sum(sum(s) / norm_len for s in seqs) / len(seqs)


def make_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 0, 3, 6, 2, 4]  # right padding, a length-1 and a fully masked sequence
    width = 6
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])
    per_token = torch.randn(len(lengths), width, generator=g, dtype=torch.float64)
    per_token[mask == 0] = float("nan")  # padding must never leak into the result
    return per_token, mask


def aggregate(mode, per_token, mask, counts):
    num_tokens, num_seqs = counts
    return AGGREGATIONS.get(mode)(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=NORM_LEN)


@pytest.mark.parametrize("mode", MODES)
def test_full_batch_value_matches_reference(mode):
    per_token, mask = make_batch()
    value = aggregate(mode, per_token, mask, batch_counts(mask))
    assert value.item() == pytest.approx(ref_aggregate(mode, per_token.tolist(), mask.tolist(), NORM_LEN))


def test_batch_counts_skip_fully_masked_sequences():
    _, mask = make_batch()
    assert batch_counts(mask) == (22.0, 6.0)  # 6+1+0+3+6+2+4 tokens, 6 non-empty sequences


PARTITIONS = [
    [[0, 1, 2, 3, 4, 5, 6]],
    [[0], [1, 2, 3, 4, 5, 6]],
    [[0, 1], [2, 3], [4, 5], [6]],
    [[0, 2, 4, 6], [1, 3, 5]],  # strided, like data-parallel ranks taking every other row
    [[5, 0, 3], [6], [2, 4, 1]],
]


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("mode", MODES)
def test_pieces_sum_to_the_full_batch_value_and_gradient(mode, partition):
    per_token, mask = make_batch(seed=1)
    counts = batch_counts(mask)
    leaf = per_token.clone().requires_grad_()
    full = aggregate(mode, leaf, mask, counts)
    (full_grad,) = torch.autograd.grad(full, leaf)

    leaf = per_token.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for rows in partition:
        piece_mask = mask[rows]
        # each microbatch is padded only to its own longest response, as the packer does
        width = max(int(piece_mask.sum(dim=1).max()), 1)
        piece = aggregate(mode, leaf[rows, :width], piece_mask[:, :width], counts)
        piece.backward()
        total = total + piece.detach()
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(leaf.grad, full_grad, rtol=1e-12, atol=1e-15)
    assert (leaf.grad[mask == 0] == 0).all()


def test_token_mean_gradient_is_one_over_the_batch_token_count():
    per_token, mask = make_batch()
    leaf = per_token.clone().requires_grad_()
    aggregate("token-mean", leaf, mask, batch_counts(mask)).backward()
    expected = torch.where(mask.bool(), 1.0 / 22.0, 0.0).double()
    torch.testing.assert_close(leaf.grad, expected)


def test_seq_mean_token_sum_norm_needs_a_positive_norm_len():
    per_token, mask = make_batch()
    with pytest.raises(ValueError, match="norm_len > 0"):
        AGGREGATIONS.get("seq-mean-token-sum-norm")(per_token, mask, num_tokens=1, num_seqs=1, norm_len=0)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_aggregates_to_zero(mode):
    value = aggregate(mode, torch.ones(2, 3), torch.zeros(2, 3), (0.0, 0.0))
    assert value.item() == 0.0


# --- sample filters -----------------------------------------------------------------------------

def ref_zero_variance(rewards: list[float], group_size: int) -> list[bool]:
    keep = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        keep += [len(set(group)) > 1] * group_size
    return keep


def test_zero_variance_drops_groups_with_equal_rewards():
    rewards = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25]
    keep = SAMPLE_FILTERS.get("zero_variance")(torch.tensor(rewards), torch.arange(12) // 3)
    assert keep.tolist() == ref_zero_variance(rewards, 3)
    assert keep.tolist() == [True] * 3 + [False] * 6 + [True] * 3


def test_zero_variance_decides_ragged_interleaved_groups_whole():
    # group 0: rows 0, 2, 5 (varied); group 1: rows 1, 4 (equal); group 2: row 3 alone (kept)
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.0, 0.5, 1.0])
    groups = torch.tensor([0, 1, 0, 2, 1, 0])
    assert SAMPLE_FILTERS.get("zero_variance")(rewards, groups).tolist() == [True, False, True, True, False, True]


def test_zero_variance_keeps_groups_of_one_and_none_keeps_all():
    rewards = torch.tensor([1.0, 1.0, 0.0])
    assert SAMPLE_FILTERS.get("zero_variance")(rewards, torch.arange(3)).all()
    assert SAMPLE_FILTERS.get("none")(rewards, torch.zeros(3, dtype=torch.int64)).all()


@pytest.mark.parametrize("name", ["none", "zero_variance"])
def test_filters_reject_group_ids_of_another_length(name):
    with pytest.raises(ValueError, match="must both be"):
        SAMPLE_FILTERS.get(name)(torch.ones(6), torch.zeros(4, dtype=torch.int64))
