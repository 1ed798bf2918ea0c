"""pass@k against brute force over all k-subsets of the n samples; mean@k by hand."""

import itertools

import pytest

from rft.explorer.bench import pass_at_k, score_table


@pytest.mark.parametrize("n, correct, k", [(4, 0, 1), (4, 1, 1), (4, 1, 4), (5, 2, 2), (6, 3, 4), (3, 3, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, correct, k):
    samples = [1] * correct + [0] * (n - correct)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, correct, k) == pytest.approx(brute)


def test_score_table_averages_over_tasks():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]  # task 0: 1 of 4 right; task 1: none
    row = score_table(rewards, [1, 4])
    assert row["pass@1"] == pytest.approx((1 / 4 + 0) / 2)
    assert row["pass@4"] == pytest.approx((1 + 0) / 2)
    assert row["mean@1"] == pytest.approx((1 + 0) / 2)  # first sample of each task
    assert row["mean@4"] == pytest.approx((1 / 4 + 0) / 2)
