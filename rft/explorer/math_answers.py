"""Final answers of math problems, compared by math-verify: the `math_verify` reward's logic
(rft/explorer/rewards.py registers it).

The gold answer comes in the layouts math datasets use:

    GSM8K           "... worked solution ...\\n#### 72"     the text after the last `####`
    MATH solution   "... so the answer is $\\boxed{\\frac12}$"  the last `\\boxed{...}`
    plain           "72", "\\frac{1}{2}", "x^2+1", "(1, 2)"   verl's reward_model.ground_truth,
                                                              DAPO-Math, AIME, MATH-500's `answer`

A plain answer is read as LaTeX, the way verl's math_verify reward reads it: wrapped in
`\\boxed{}` before math-verify parses it. Parsed bare, math-verify finds nothing in
"\\sqrt{2}" and only the 2 of "2\\sqrt{3}" (it looks for a number or delimited LaTeX), so such a
gold answer never scored.

Timeouts are off here (`parsing_timeout=None`, `timeout_seconds=None`): math-verify implements
them with SIGALRM, which raises ValueError outside the main thread and would clobber the caller's
own alarm handler. `RewardScorer` enforces the time limit instead.
"""

from __future__ import annotations

from typing import Any


def gsm8k_gold(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last `####`, commas removed.

    An answer without `####` is taken to be the final answer already (e.g. a bare "72").
    """
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def last_boxed(text: str) -> str | None:
    """`\\boxed{...}` (or `\\fbox{...}`), the last one of `text`, braces balanced; None if none.

    Only the last: math-verify given a whole solution with two boxes reads both, as a set."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    depth = 0
    for end in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1]
    return None  # unbalanced: let math-verify try the whole text


def parse_gold(answer: str) -> list[Any]:
    """What math-verify parses from a gold answer in any of the layouts above ([] if nothing)."""
    from math_verify import parse

    if "####" in answer:  # GSM8K, exactly as before plain and boxed answers were read
        return parse(gsm8k_gold(answer), parsing_timeout=None)
    boxed = last_boxed(answer)
    if boxed is not None:
        return parse(boxed, parsing_timeout=None)
    if "\\boxed" in answer or "\\fbox" in answer:  # `\boxed 5`, or braces that do not balance
        return parse(answer, parsing_timeout=None)
    return parse("\\boxed{" + answer.strip() + "}", parsing_timeout=None) or parse(answer, parsing_timeout=None)


def parse_response(response: str) -> list[Any]:
    """What math-verify parses as the response's final answer: `\\boxed{72}`, "The answer is 72",
    a bare "72" (the last number it finds otherwise). A response in GSM8K's own format is read
    after its last `####` first, so "#### 72\\nHope this helps, 5 stars" is not read as 5."""
    from math_verify import parse

    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip().splitlines()
        if tail:
            pred = parse(tail[0].replace(",", ""), parsing_timeout=None)
            if pred:
                return pred
    return parse(response, parsing_timeout=None)


def math_verify_answer(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equal to the gold answer (GSM8K's
    `#### 72`, a `\\boxed{}` solution or a plain answer); 0.0 otherwise, or if the response has none."""
    # imported here, not at the top: math-verify loads sympy's LaTeX parser (0.75 s), which the
    # launcher's check of the reward name and every run without this reward would pay for nothing.
    # RewardScorer imports it before forking (the `preload` of the registered reward), so no child pays it.
    from math_verify import verify

    gold = parse_gold(answer)
    if not gold:
        raise ValueError(
            f"math_verify cannot parse the gold answer {answer!r}; check that data.answer_key names a "
            f"column holding final answers: GSM8K's '...#### 72', a solution with '\\boxed{{...}}', or "
            f"a plain answer ('72', '\\frac{{1}}{{2}}')"
        )
    pred = parse_response(response)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
