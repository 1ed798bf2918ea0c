"""duplicate_of: exact and MinHash near-duplicate detection, shared by taskset dedup and response dedup.

Expected outcomes below were decided from the character-3-gram Jaccard similarities (true value /
MinHash estimate with num_perm=128, seed=1):
  GSM8K-like prompt vs spacing variant 0.94 / 0.95, vs 48 -> 72 0.93 / 0.98, vs paraphrase 0.41 / 0.48;
  "What is 2 plus 3?" vs "what is 2 plus 3 ?" 0.82 / 0.79, vs "What is 2 plus 4?" 0.77 / 0.77.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rft.data.near_duplicates import duplicate_of, normalise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?")
SPACED = BASE.replace("May?", "May ?").replace("April,", "April ,")
NUMBER = BASE.replace("48", "72")
PARAPHRASE = ("In April Natalia sold 48 clips to her friends, and in May she sold half that many. "
              "What is the total number of clips she sold in both months?")
SHORT = ["What is 2 plus 3?", "what is 2 plus 3 ?", "What is 2 plus 4?", "Compute the sum of 2 and 3."]


def test_normalise_lowercases_and_collapses_whitespace():
    assert normalise("  What\tIS\n\n2 +  3? ") == "what is 2 + 3?"


def test_exact_mode_matches_normalised_text_and_points_at_the_first():
    texts = ["What is 2 plus 3?", "what  is 2 plus 3?  ", "What is 2 plus 4?", "WHAT IS 2\nPLUS 3?",
             "What is 2 plus 4?"]
    assert duplicate_of(texts) == [None, 0, None, 0, 2]
    # a space before the question mark is a different text when matching exactly
    assert duplicate_of(SHORT) == [None, None, None, None]


def test_near_duplicates_of_a_long_prompt_depend_on_the_threshold():
    texts = [BASE, SPACED, NUMBER, PARAPHRASE]
    assert duplicate_of(texts, threshold=1.0) == [None, None, None, None]
    # at 0.9 the spacing variant and, as documented, the changed number are near-duplicates; the
    # paraphrase (0.41) is not
    assert duplicate_of(texts, threshold=0.9) == [None, 0, 0, None]
    assert duplicate_of(texts, threshold=0.3) == [None, 0, 0, 0]


def test_near_duplicates_of_short_prompts():
    # a short prompt has few shingles: one changed character moves the estimate by ~0.1
    assert duplicate_of(SHORT, threshold=0.7) == [None, 0, 0, None]
    assert duplicate_of(SHORT, threshold=0.9) == [None, None, None, None]


def test_exact_duplicates_are_duplicates_at_any_threshold_and_short_texts_compare_exactly():
    texts = ["ab", "AB", "ac", "a", "A", BASE, BASE.upper()]
    # "ab", "ac" and "a" are shorter than shingle=3: no similarity is estimated for them, so "ac"
    # is not a near-duplicate of "ab" even at 0.1
    assert duplicate_of(texts, threshold=0.1) == [None, 0, None, None, 3, None, 5]


def test_only_first_of_kind_texts_are_matched_so_chains_do_not_grow():
    s = "abcdefghijklmnopqrstuvwxyz0123456789"
    a, b, c = s[0:20], s[4:24], s[8:28]  # J(a, b) = J(b, c) = 0.64, J(a, c) = 0.38
    result = duplicate_of([a, b, c], threshold=0.55)
    assert result == [None, 0, None]  # c resembles b, but b was dropped as a's duplicate
    assert all(result[j] is None for j in result if j is not None)


def test_earliest_match_is_returned_not_the_most_similar():
    s = "abcdefghijklmnopqrstuvwxyz0123456789"
    a, b, c = s[0:20], s[4:24], s[8:28]  # estimates: (a, b) 0.61, (b, c) 0.71, (a, c) 0.43
    assert duplicate_of([a, c, b], threshold=0.55) == [None, None, 0]
    texts = [PARAPHRASE, BASE, SPACED]
    assert duplicate_of(texts, threshold=0.9) == [None, None, 1]
    assert duplicate_of(texts, threshold=0.3) == [None, 0, 0]


def test_empty_input():
    assert duplicate_of([]) == []
    assert duplicate_of([], threshold=0.5) == []


@pytest.mark.parametrize("kwargs, named", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"), ({"threshold": "0.8"}, "threshold"),
    ({"threshold": True}, "threshold"), ({"threshold": 0.8, "num_perm": 1}, "num_perm"),
    ({"threshold": 0.8, "shingle": 0}, "shingle"),
    ({"threshold": 0.99, "num_perm": 128}, "num_perm"),  # LSH needs >= 2 bands: 0.99 needs num_perm >= 512
])
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        duplicate_of(["some text", "other text"], **kwargs)


def test_a_text_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        duplicate_of(["a", None])  # type: ignore[list-item]


def _corpus() -> list[str]:
    texts = [BASE, SPACED, NUMBER, PARAPHRASE, *SHORT]
    texts += [f"Tom has {n} apples and gives {n % 7} of them away. How many are left?" for n in range(40)]
    texts += [f"tom has {n} apples and gives {n % 7} of them away.  how many are left ?" for n in range(0, 40, 3)]
    return texts


def other_hash_seed() -> str:
    """A PYTHONHASHSEED unlike this process's (random unless the environment fixes it)."""
    return "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"


def test_same_result_in_another_process_with_another_hash_seed():
    texts = _corpus()
    here = {str(t): duplicate_of(texts, threshold=t) for t in (1.0, 0.8, 0.5)}
    code = ("import json, sys; from rft.data.near_duplicates import duplicate_of; texts = json.load(sys.stdin); "
            "print(json.dumps({str(t): duplicate_of(texts, threshold=t) for t in (1.0, 0.8, 0.5)}))")
    env = {**os.environ, "PYTHONHASHSEED": other_hash_seed(), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60, check=True)
    assert json.loads(out.stdout) == here
    assert any(x is not None for x in here["0.8"])  # the comparison is not vacuous


def test_fast_enough_for_ten_thousand_short_texts():
    texts = [f"Tom has {n} apples and gives {n % 13} of them to Ann. How many apples are left?" for n in range(5000)]
    texts += [t.replace("apples", "apple") for t in texts]  # near-duplicates, not exact ones
    start = time.perf_counter()
    result = duplicate_of(texts, threshold=0.8)
    assert sum(x is not None for x in result[5000:]) > 4000
    assert time.perf_counter() - start < 20  # ~1-2 s on 2 cores; the bound only catches a quadratic blow-up
