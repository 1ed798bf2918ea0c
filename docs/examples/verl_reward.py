"""A reward in verl's form for rft's CPU quickstart (two-digit addition: the prompt "12+56=", the
answer column "68"). Use it by file path, from the repository's root:

    python -m rft.launch +experiment=quickstart algorithm.reward=docs/examples/verl_reward.py:compute_score

rft calls it with the task row's `data_source` (None here: the quickstart's rows have no such
column), the response text, the row's answer and its `extra_info` ({} here).
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the model continues "a+b=": its answer is the first line of the response
    lines = solution_str.strip().splitlines()
    answer = lines[0].rsplit("=", 1)[-1].strip() if lines else ""
    correct = answer == ground_truth.strip()
    # "score" is the reward; the other numbers are logged as rollout/<key> (the step's mean)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "answered": answer.isdigit()}
