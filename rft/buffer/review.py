"""Human review in the loop: route groups to a person, train on the scores they give.

    explorer:  the `review` experience operator writes a group (a task's prompt and samples) to
               <run>/review/queue/ when it matches `when` (rft/review/queue.py)
    person:    `python -m rft.review <run>` (a terminal UI) scores the responses
    trainer:   each step, rank 0 adds the groups labelled since the last step to the batch, with
               the person's scores as rewards (a response left unscored keeps its reward)

A labelled group joins a later step's batch as a whole group, so group-relative advantages
compare the person's scores with each other. Its rows were sampled by older weights: a step
holding them is trained with truncated importance weights, as replayed experience is
(rft/trainer/trainer.py). The intake remembers which items it trained (a checkpoint component),
so after a restart nothing is trained twice and the queue, a directory of files, is intact.
Labels also make SFT and DPO data for a later stage: `python -m rft.review <run> --export sft|dpo`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from rft.buffer.experience import Experience, to_table
from rft.buffer.operator_registry import EXPERIENCE_OPERATORS, OperatorContext, groups_of

REVIEW_REASONS = ("flagged", "disagree", "sample", "always")


def _fraction_picks(group_id: str, fraction: float) -> bool:
    """A stable coin per group (the same on every engine and every resumed attempt)."""
    draw = int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "big") / 2**64
    return draw < fraction


def _reason(rows: list[Experience], when: Sequence[str], flag_metric: str, judge_metric: str, tolerance: float,
            fraction: float) -> str | None:
    """Why the group goes to review, or None."""
    for rule in when:
        if rule == "always":
            return "always"
        if rule == "flagged" and any(e.metrics.get(flag_metric) for e in rows):
            return f"flagged ({flag_metric})"
        if rule == "disagree":
            gaps = [abs(e.reward - e.metrics[judge_metric]) for e in rows if judge_metric in e.metrics]
            if gaps and max(gaps) > tolerance:
                return f"{judge_metric} and reward disagree by {max(gaps):.2f}"
        if rule == "sample" and _fraction_picks(rows[0].group_id, fraction):
            return f"sampled ({fraction:g} of groups)"
    return None


@EXPERIENCE_OPERATORS.register("review")
def review(experiences: list[Experience], when: Sequence[str] = ("flagged",), flag_metric: str = "flagged",
           judge_metric: str = "judge", tolerance: float = 0.5, fraction: float = 0.0, keep: bool = True,
           ctx: OperatorContext | None = None) -> list[Experience]:
    """Send each group matching a rule of `when` to <run>/review/queue/: `flagged` (a sample's
    metrics[flag_metric] is true, e.g. set by a workflow), `disagree` (|reward - metrics[judge_metric]|
    > tolerance, e.g. a judge's score kept as a metric), `sample` (a stable `fraction` of groups),
    `always`. With `keep` the group trains now as well; without, only after its review."""
    from rft.review.queue import enqueue

    when = [when] if isinstance(when, str) else list(when)
    unknown = [w for w in when if w not in REVIEW_REASONS]
    if unknown:
        raise ValueError(f"review: when={unknown} unknown; use some of {REVIEW_REASONS}")
    ctx = ctx or OperatorContext()
    routed: set[str] = set()
    for group_id, rows in groups_of(experiences).items():
        reason = _reason(rows, when, flag_metric, judge_metric, tolerance, fraction)
        if reason is None:
            continue
        routed.add(group_id)
        first = rows[0]
        enqueue(ctx.run_dir, {
            "id": group_id, "step": ctx.step, "reason": reason, "task_id": first.task_id,
            "prompt": ctx.decode(first.token_ids[: first.prompt_length]),
            "responses": [{"text": e.response, "reward": float(e.reward), "metrics": e.metrics} for e in rows],
            "experiences": [_as_json(e) for e in rows]})
    return experiences if keep else [e for e in experiences if e.group_id not in routed]


def _as_json(e: Experience) -> dict:
    """An experience as a review item stores it (JSON: routed experts as nested lists)."""
    row = dataclasses.asdict(e)
    if e.routed_experts is not None:
        row["routed_experts"] = e.routed_experts.tolist()
    return row


class ReviewIntake:
    """Trainer rank 0's reader of labels: the groups labelled since the last step, as rows whose
    rewards are the person's scores. A checkpoint component ("review")."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.trained: list[str] = []  # item ids already trained, in the order they were

    def take(self, step: int) -> tuple[pa.Table | None, dict[str, float]]:
        """The groups labelled since the last call, for trainer step `step`."""
        from rft.review.queue import item, labels

        # only the items labelled since the last step are read: items carry whole trajectories
        done, given = set(self.trained), labels(self.run_dir)
        new = sorted(i for i, label in given.items() if i not in done and label["verdict"] == "scored")
        fresh = [found for found in (item(self.run_dir, i) for i in new) if found is not None and found["id"] in given]
        fresh.sort(key=lambda found: (found["step"], found["id"]))  # the queue's order, as before
        rows = []
        for group in fresh:
            scores = given[group["id"]]["scores"]
            for score, row in zip(scores, group["experiences"]):
                e = Experience(**row)
                if e.routed_experts is not None:  # JSON holds it as nested lists
                    e.routed_experts = np.asarray(e.routed_experts, dtype=np.uint16)
                rows.append(dataclasses.replace(e, reward=float(score)) if score is not None else e)
            self.trained.append(group["id"])
        scalars = {"review/groups": float(len(fresh)), "review/rows": float(len(rows)),
                   "review/labelled_total": float(len(self.trained))}
        return (to_table(rows) if rows else None), scalars

    def state_dict(self) -> dict:
        return {"trained": list(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.trained = list(state["trained"])
