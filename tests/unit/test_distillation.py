"""On-policy distillation: the advantages on fixed tensors against their formulas by hand, their
expectation against autograd's gradient of the divergence on a whole vocabulary, the teacher's
logprobs through the experience schema and the trainer's batch, and the launch checks."""

import asyncio
import math
import os

import pytest
import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rft.buffer.experience import Experience, from_table, to_table
from rft.config.checks import validate
from rft.trainer.step_batch import StepBatch, batch_advantages, teacher_scalars
from tests.openai_stub import OpenAIStub
from tests.unit.test_config import compose_cfg

STUDENT = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -3.0, 0.0]])
TEACHER = torch.tensor([[-1.0, -0.5, -1.0], [-2.0, -0.2, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def inputs(scored=(1.0, 1.0)) -> AdvantageInputs:
    return AdvantageInputs(rewards=torch.zeros(2), group_ids=torch.tensor([0, 0]), mask=MASK,
                           old_logprobs=STUDENT, teacher_logprobs=TEACHER, teacher_scored=torch.tensor(scored))


def cfg(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{"distill_coef": 1.0, "jsd_beta": 0.5, **kw})


def test_on_policy_distill_is_minus_the_reverse_kl_estimate_per_token():
    out = ADVANTAGES.resolve("on_policy_distill")(inputs(), cfg(distill_coef=2.0)).advantages
    expected = torch.tensor([[-2 * (-0.5 + 1.0), -2 * (-2.0 + 0.5), 0.0],  # -(s - t) * coef; s == t -> 0
                             [-2 * (-0.1 + 2.0), -2 * (-3.0 + 0.2), 0.0]])  # padding -> 0
    torch.testing.assert_close(out, expected)


def test_a_row_the_teacher_did_not_score_gets_no_advantage():
    out = ADVANTAGES.resolve("on_policy_distill")(inputs(scored=(1.0, 0.0)), cfg()).advantages
    assert out[1].abs().sum() == 0 and out[0].abs().sum() > 0


def test_jsd_is_minus_one_minus_beta_times_the_log_ratio_to_the_mixture():
    beta = 0.3
    out = ADVANTAGES.resolve("jsd")(inputs(), cfg(jsd_beta=beta)).advantages
    s, t = -0.5, -1.0
    m = math.log(beta * math.exp(t) + (1 - beta) * math.exp(s))
    assert out[0, 0].item() == pytest.approx(-(1 - beta) * (s - m), rel=1e-5)
    assert out[0, 2].item() == pytest.approx(0.0, abs=1e-6)  # student == teacher: m == both
    assert out[1, 2].item() == 0.0  # padding
    with pytest.raises(ValueError, match="jsd_beta"):
        ADVANTAGES.resolve("jsd")(inputs(), cfg(jsd_beta=1.0))


def _expected_gradient(advantage_of, logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """E_{y ~ pi_s}[A(y) grad log pi_s(y)], exactly (a sum over the vocabulary), A detached: what the
    policy gradient on the sampled tokens estimates."""
    logp = torch.log_softmax(logits, dim=-1)
    adv = advantage_of(logp.detach(), teacher_logp)
    surrogate = (logp.detach().exp() * adv * logp).sum()
    return torch.autograd.grad(surrogate, logits)[0]


def test_the_advantages_expected_policy_gradient_is_minus_the_divergences_gradient():
    torch.manual_seed(0)
    logits = torch.randn(7, requires_grad=True)
    teacher_logp = torch.log_softmax(torch.randn(7), dim=-1)
    ones = torch.ones(1, 7)

    def distill(student, teacher):
        return ADVANTAGES.resolve("on_policy_distill")(
            AdvantageInputs(rewards=torch.zeros(1), group_ids=torch.tensor([0]), mask=ones,
                            old_logprobs=student[None], teacher_logprobs=teacher[None]), cfg()).advantages[0]

    def jsd(student, teacher, beta=0.3):
        return ADVANTAGES.resolve("jsd")(
            AdvantageInputs(rewards=torch.zeros(1), group_ids=torch.tensor([0]), mask=ones,
                            old_logprobs=student[None], teacher_logprobs=teacher[None]), cfg(jsd_beta=beta)).advantages[0]

    logp = torch.log_softmax(logits, dim=-1)
    reverse_kl = (logp.exp() * (logp - teacher_logp)).sum()
    torch.testing.assert_close(_expected_gradient(distill, logits, teacher_logp),
                               -torch.autograd.grad(reverse_kl, logits)[0])

    beta = 0.3
    logp = torch.log_softmax(logits, dim=-1)
    mixture = torch.log(beta * teacher_logp.exp() + (1 - beta) * logp.exp())
    divergence = beta * (teacher_logp.exp() * (teacher_logp - mixture)).sum() + \
        (1 - beta) * (logp.exp() * (logp - mixture)).sum()
    true_gradient = torch.autograd.grad(divergence, logits)[0]
    torch.testing.assert_close(_expected_gradient(jsd, logits, teacher_logp), -true_gradient)

    # Trinity-RFT's "jsd" advantage (minus the divergence's sampled-token value) does not follow it:
    # the direction differs (cosine well below 1), which is why rft uses the gradient's weight
    def value_form(student, teacher):
        m = torch.log(beta * teacher.exp() + (1 - beta) * student.exp())
        return -(beta * teacher.exp() * (teacher - m) + (1 - beta) * student.exp() * (student - m))

    other = _expected_gradient(value_form, logits, teacher_logp)
    assert torch.nn.functional.cosine_similarity(other, -true_gradient, dim=0) < 0.9


def test_teacher_logprobs_round_trip_through_a_shard_and_into_the_trainers_batch():
    rows = [Experience(token_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -2.0], prompt_length=2,
                       reward=1.0, group_id="g", trajectory_id="g:0", teacher_logprobs=[0.0, -1.0, -1.0, -0.5]),
            Experience(token_ids=[1, 2, 5], loss_mask=[0, 0, 1], logprobs=[0, 0, -0.1], prompt_length=2,
                       reward=0.0, group_id="g", trajectory_id="g:1")]  # the teacher did not answer
    back = from_table(to_table(rows))
    assert back[0].teacher_logprobs == [0.0, -1.0, -1.0, -0.5] and back[1].teacher_logprobs is None
    old_shard = to_table(rows).drop_columns(["teacher_logprobs"])  # written before the column existed
    assert all(e.teacher_logprobs is None for e in from_table(old_shard))

    batch = StepBatch.from_experiences(back)
    assert batch.teacher_logprobs == [[-1.0, -0.5], None]  # response-aligned, like old_logprobs
    algo = compose_cfg("+experiment=quickstart", "algorithm=on_policy_distill").algorithm
    advantages = batch_advantages(batch, algo, None).advantages
    torch.testing.assert_close(advantages, torch.tensor([[-(-0.5 + 1.0), -(-2.0 + 0.5)], [0.0, 0.0]]))
    scalars = teacher_scalars(batch)
    assert scalars["distill/rows_unscored"] == 1.0
    assert scalars["distill/reverse_kl"] == pytest.approx(((-0.5 + 1.0) + (-2.0 + 0.5)) / 2)

    with pytest.raises(ValueError, match="teacher_logprobs \\(3\\)"):
        Experience(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, -1], prompt_length=1,
                   teacher_logprobs=[0.0, -1.0, -2.0]).check()


def test_distillation_needs_a_named_teacher_on_a_judge_engine_with_the_students_tokenizer(tmp_path):
    base = ["+experiment=quickstart", f"run.output_dir={tmp_path}", "stages=[{name:rl}]", "algorithm=on_policy_distill"]
    with pytest.raises(ValueError, match="algorithm.advantage='on_policy_distill' is invalid: .*cluster.judge_ranks=1"):
        validate(compose_cfg(*base))
    with pytest.raises(ValueError, match="judge.model=None is invalid: .*needs a teacher"):
        validate(compose_cfg(*base, "cluster.judge_ranks=1"))

    from rft.config import TinyModelConfig
    from rft.models.tiny import create_tiny_model

    student = create_tiny_model(TinyModelConfig(), str(tmp_path / "student"), seed=0)
    same = [*base, "cluster.judge_ranks=1", f"judge.model={student}", "model.tiny=null", f"model.path={student}"]
    validate(compose_cfg(*same))
    smollm2 = os.path.expanduser("~/.cache/rft/models/smollm2-135m-instruct")
    if not os.path.isfile(os.path.join(smollm2, "tokenizer.json")):
        pytest.skip("SmolLM2 not prepared (python tools/prepare_smollm2.py)")
    with pytest.raises(ValueError, match="judge.model=.* the teacher's tokenizer differs from the student's"):
        validate(compose_cfg(*base, "cluster.judge_ranks=1", f"judge.model={smollm2}", "model.tiny=null",
                             f"model.path={student}"))


def teacher_logprobs(path: str, body: dict) -> dict:
    """What vLLM answers with `prompt_logprobs`: per prompt, None at position 0, then
    {token id: {"logprob": -0.1 x position}}."""
    choices = [{"index": k, "text": "x", "finish_reason": "length", "logprobs": None,
                "prompt_logprobs": [None] + [{str(t): {"logprob": -0.1 * i, "rank": 1}} for i, t in
                                             enumerate(prompt) if i > 0]}
               for k, prompt in enumerate(body["prompt"])]
    return {"id": "x", "object": "text_completion", "created": 0, "model": body["model"], "choices": choices}


def test_the_teacher_scores_a_group_in_one_request_up_to_its_context_and_a_dead_one_costs_the_rows(capsys):
    from rft.config import JudgeConfig
    from rft.explorer.judge import JudgeClient, JudgeEndpoint, judge
    from rft.explorer.teacher import Teacher

    server = OpenAIStub(teacher_logprobs)
    rows = [Experience(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0, -1.0, -2.0], prompt_length=1),
            Experience(token_ids=[5, 6, 7, 8, 9], loss_mask=[0, 1, 1, 1, 1], logprobs=[0, -1.0, -2.0, -3.0, -4.0],
                       prompt_length=1)]
    try:
        judge.client = JudgeClient([JudgeEndpoint(server.url, "token", "teacher")], JudgeConfig(timeout_s=10))
        assert asyncio.run(Teacher(context=4).score(rows)) == 0
        # one request; no prompt longer than context - 1
        assert [body["prompt"] for _, body in server.requests] == [[[5, 6, 7], [5, 6, 7]]]
        assert rows[0].teacher_logprobs == pytest.approx([0.0, -0.1, -0.2])
        # positions past the teacher's context keep the student's logprobs: advantage 0 there
        assert rows[1].teacher_logprobs == pytest.approx([0.0, -0.1, -0.2, -3.0, -4.0])
        server.close()
        judge.client = JudgeClient([JudgeEndpoint(server.url, "token", "teacher")], JudgeConfig(timeout_s=10))
        teacher, fresh = Teacher(context=4), [Experience(token_ids=[5, 6], loss_mask=[0, 1], logprobs=[0, -1.0],
                                                         prompt_length=1)]
        assert asyncio.run(teacher.score(fresh)) == 1 and asyncio.run(teacher.score(fresh)) == 1
        assert fresh[0].teacher_logprobs is None and judge.client.counts.errors == 2
        assert capsys.readouterr().out.count("teacher: judge engine 0") == 1  # said once, then only counted
    finally:
        judge.client = None
