"""Rewards on realistic responses, the registry's errors, and RewardScorer's failure handling."""

from __future__ import annotations

import logging
import os
import time

import pytest

from rft.explorer.rewards import (
    REWARDS,
    RewardScorer,
    exact_match,
    get_reward,
    gsm8k_gold,
    math_verify_reward,
    register_reward,
)

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.fixture
def registered():
    """Register test-only rewards and remove them afterwards, so tests do not leak names."""
    added: list[str] = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)

    yield add
    for name in added:
        REWARDS.pop(name, None)


@pytest.mark.parametrize("response", ["68", " 68 ", "68\n", "68\njunk 12+3=15", "\n 68\t\nmore"])
def test_exact_match_accepts_answer_on_first_line(response):
    assert exact_match(response, "68") == 1.0


@pytest.mark.parametrize("response", ["", "6", "680", "68.0", "068", "The answer is 68",
                                      "junk\n68", "68 apples", "-68"])
def test_exact_match_rejects_anything_else(response):
    assert exact_match(response, "68") == 0.0


def test_gsm8k_gold_takes_text_after_hashes_without_commas():
    assert gsm8k_gold(GSM8K_GOLD) == "72"
    assert gsm8k_gold("so 1,000 + 200 = 1,200\n#### 1,200") == "1200"
    assert gsm8k_gold("72") == "72"


@pytest.mark.parametrize("response", [
    "She sold 48/2 = 24 in May, so 48 + 24 = 72 in total.\n#### 72",
    "... so she has 72 apples.\n#### 72",
    "The answer is \\boxed{72}",
    "The answer is 72.",
    "72",
    "#### 72.0",
    "#### 72\nI hope this helps! 5 stars.",
])
def test_math_verify_accepts_correct_final_answers(response):
    assert math_verify_reward(response, GSM8K_GOLD) == 1.0


@pytest.mark.parametrize("response", [
    "I don't know",
    "",
    "The answer is 73",
    "First 10 + 62 = 72, then the answer is \\boxed{73}",
    "#### 27",
])
def test_math_verify_rejects_wrong_or_missing_answers(response):
    assert math_verify_reward(response, GSM8K_GOLD) == 0.0


def test_math_verify_handles_thousands_separators():
    assert math_verify_reward("The answer is 1,200", "... \n#### 1,200") == 1.0
    assert math_verify_reward("#### 1,200", "#### 1200") == 1.0


def test_math_verify_works_off_the_main_thread():
    # math-verify's default SIGALRM timeouts raise ValueError outside the main thread.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(math_verify_reward, "\\boxed{72}", GSM8K_GOLD).result() == 1.0


def test_registry_lookup_and_unknown_name():
    assert get_reward("exact_match") is exact_match
    assert get_reward("math_verify") is math_verify_reward
    with pytest.raises(ValueError) as err:
        get_reward("exact_mtach")
    message = str(err.value)
    assert "algorithm.reward='exact_mtach'" in message
    assert "exact_match" in message and "math_verify" in message


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(lambda response, answer: 0.0)
    assert get_reward("exact_match") is exact_match


def test_scorer_scores_a_batch_in_order():
    with RewardScorer("exact_match", timeout_s=5) as scorer:
        assert scorer.score(["68", "12\nx", "nope"], ["68", "12", "3"]) == [1.0, 1.0, 0.0]
        assert (scorer.errors, scorer.timeouts) == (0, 0)


def test_scorer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rollout.reward_timeout_s"):
        RewardScorer("exact_match", timeout_s=0)
    with pytest.raises(ValueError, match="algorithm.reward"):
        RewardScorer("nope", timeout_s=1)
    with RewardScorer("exact_match", timeout_s=1) as scorer, pytest.raises(ValueError, match="answer"):
        scorer.score(["1", "2"], ["1"])


def test_raising_reward_scores_zero_counts_and_logs_once(registered, caplog):
    def picky(response: str, answer: str) -> float:
        if response == "bad":
            raise RuntimeError(f"cannot score {response!r}")
        return 1.0

    registered("test_picky", picky)
    with RewardScorer("test_picky", timeout_s=5) as scorer, caplog.at_level(logging.WARNING):
        assert scorer.score(["ok", "bad", "ok", "bad"], ["a"] * 4) == [1.0, 0.0, 1.0, 0.0]
        assert (scorer.errors, scorer.timeouts) == (2, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "RuntimeError" in warnings[0] and "cannot score 'bad'" in warnings[0]


def test_non_finite_reward_counts_as_error(registered):
    registered("test_nan", lambda response, answer: float("nan"))
    with RewardScorer("test_nan", timeout_s=5) as scorer:
        assert scorer.score(["x"], ["y"]) == [0.0]
        assert scorer.errors == 1


def test_sleeping_reward_times_out_quickly_and_scoring_goes_on(registered, caplog):
    def sleepy(response: str, answer: str) -> float:
        if response == "slow":
            time.sleep(30)
        return 1.0

    registered("test_sleepy", sleepy)
    with RewardScorer("test_sleepy", timeout_s=0.2) as scorer, caplog.at_level(logging.WARNING):
        start = time.monotonic()
        scores = scorer.score(["fast", "slow", "fast", "slow"], ["a"] * 4)
        elapsed = time.monotonic() - start
        assert scores == [1.0, 0.0, 1.0, 0.0]
        assert (scorer.errors, scorer.timeouts) == (0, 2)
    assert elapsed < 3.0, f"two 0.2 s timeouts took {elapsed:.1f} s"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rollout.reward_timeout_s" in warnings[0]


def test_gil_holding_math_verify_input_cannot_hang_the_scorer():
    # sympy evaluates this power tower in C while holding the GIL: a thread-based timeout would
    # never regain control. The child process is killed instead.
    with RewardScorer("math_verify", timeout_s=2.0) as scorer:
        start = time.monotonic()
        scores = scorer.score(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{72}"], [GSM8K_GOLD] * 2)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0]
        assert (scorer.errors, scorer.timeouts) == (0, 1)
    assert elapsed < 10.0


def test_reward_that_kills_its_process_counts_as_error_and_scoring_goes_on(registered):
    def crashy(response: str, answer: str) -> float:
        if response == "crash":
            os._exit(3)
        return 1.0

    registered("test_crashy", crashy)
    with RewardScorer("test_crashy", timeout_s=5) as scorer:
        assert scorer.score(["crash", "fine"], ["a", "a"]) == [0.0, 1.0]
        assert (scorer.errors, scorer.timeouts) == (1, 0)
