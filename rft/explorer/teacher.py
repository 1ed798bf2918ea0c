"""The teacher of on-policy distillation: a judge engine that scores the student's samples.

    algorithm.advantage=on_policy_distill (or jsd)  +  cluster.judge_ranks=1  +  judge.model=<teacher>

    for each batch of a task's samples, once they are back and scored:
        teacher_logprobs = await judge.token_logprobs([row.token_ids for row in rows])   # one request
        (a row that fills the teacher's context: its last token keeps the student's logprob)
        a row the teacher did not answer for (judge.timeout_s, an error) keeps None: the trainer
        gives it advantage 0 and rollout/teacher_unscored counts it

The teacher is the judge role (rft/explorer/judge_rank.py): a frozen vLLM engine in the same
allocation, with its own ranks, TP and memory, never synced, so the trainer cannot update it. It
scores token ids, not text: the student's exact samples, in the context it saw them. That needs the
same tokenizer, checked at launch (`check_same_tokenizer`). Evaluation rollouts are not scored.
"""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.explorer.judge import JudgeError, judge


def needs_teacher(advantage: str) -> bool:
    """Does this advantage estimator read a teacher's logprobs (registered `needs_teacher=True`)?"""
    from rft.algorithms.advantages import ADVANTAGES

    return bool(ADVANTAGES.meta(ADVANTAGES.resolve(advantage)).get("needs_teacher"))


class Teacher:
    """Scores a task's rows with the judge engine. `context`: the teacher's context length (its
    config.json's). vLLM scores a prompt only while it generates a token after it, so a row that
    fills the teacher's whole context is scored up to its last token; that token gets the student's
    own logprob, i.e. advantage 0 (no signal, rather than no row)."""

    def __init__(self, context: int):
        self.context, self.warned = context, False

    async def score(self, experiences: list[Experience]) -> int:
        """Fill each row's `teacher_logprobs` in one request; on a timeout or an error leave them
        None (JudgeClient counts it, and the first failure is printed). Returns the rows unscored."""
        fits = self.context - 1
        try:
            scored = await judge.token_logprobs([e.token_ids[:fits] for e in experiences])
        except JudgeError as err:
            if not self.warned:
                self.warned = True
                print(f"teacher: {err}; its rows keep no teacher logprobs and take no gradient (counted in "
                      "rollout/teacher_unscored; further failures only counted)", flush=True)
            return len(experiences)
        for exp, logprobs in zip(experiences, scored):
            exp.teacher_logprobs = logprobs + exp.logprobs[len(logprobs):]
        return 0


def unscored_rows(experiences: list[Experience]) -> int:
    """Rows of a batch that a teacher should have scored and did not (rollout/teacher_unscored)."""
    return sum(e.teacher_logprobs is None for e in experiences)


def check_same_tokenizer(teacher_path: str, student_path: str) -> None:
    """ValueError unless the teacher reads token ids as the student writes them: the same
    vocabulary (token -> id) and special tokens. Distillation compares the two models' logprobs of
    the same ids; with another tokenizer they would be logprobs of other strings."""
    from transformers import AutoTokenizer

    teacher, student = (AutoTokenizer.from_pretrained(path) for path in (teacher_path, student_path))
    if teacher.get_vocab() != student.get_vocab():
        only_teacher = len(set(teacher.get_vocab().items()) - set(student.get_vocab().items()))
        raise ValueError(f"judge.model={teacher_path}: the teacher's tokenizer differs from the student's "
                         f"(model.path={student_path}): {only_teacher} of its {len(teacher.get_vocab())} "
                         "(token, id) pairs are not the student's. On-policy distillation scores the student's "
                         "token ids with the teacher, so both must share one tokenizer: pick a teacher of the "
                         "same family (e.g. a larger model of the same series)")
