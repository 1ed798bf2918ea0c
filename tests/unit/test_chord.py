"""CHORD: mu's schedule and the phi weights by hand; expert rows appended to an RL batch take no
part in its advantages; and on the tiny model (real megatron-core, one CPU gloo rank) a mixed
step's gradient is (1 - mu) x the RL rows' own step's + mu x the expert rows' SFT step's, each part
normalised by its own tokens, whatever their share of the rows."""

import math

import pytest
import torch

from rft.algorithms.chord import chord_mu, expert_token_loss
from rft.config import AlgorithmConfig
from rft.trainer.step_batch import StepBatch, batch_advantages
from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_packing import MASKS, PROMPTS, RESPONSES
from tests.unit.test_skip_zero_advantage import EveryStepOptimizer

REWARDS = [1.0, 0.0, 1.0, 0.0]
GROUPS = [0, 0, 1, 1]
MU = 0.3


def test_mu_warms_up_linearly_then_decays_along_a_cosine_to_the_valley():
    assert chord_mu(0, 4, 10, 0.8, 0.1) == 0.0
    assert chord_mu(2, 4, 10, 0.8, 0.1) == pytest.approx(0.4)
    assert chord_mu(4, 4, 10, 0.8, 0.1) == pytest.approx(0.8)
    assert chord_mu(9, 4, 10, 0.8, 0.1) == pytest.approx(0.1 + 0.7 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert chord_mu(14, 4, 10, 0.8, 0.1) == pytest.approx(0.1) == chord_mu(500, 4, 10, 0.8, 0.1)
    assert chord_mu(0, 0, 0, 0.1, 0.02) == chord_mu(99, 0, 0, 0.1, 0.02) == 0.1  # no schedule: constant peak


def test_phi_weights_each_expert_token_by_p_times_one_minus_p_without_a_gradient_through_it():
    logprobs = torch.log(torch.tensor([[0.5, 0.9, 0.2]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = expert_token_loss(logprobs, mask, phi=True)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-0.25 * math.log(0.5), -0.09 * math.log(0.9), 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.09, 0.0]]))  # d/dlogp of -phi * logp
    torch.testing.assert_close(expert_token_loss(logprobs.detach(), mask, phi=False),
                               torch.tensor([[-math.log(0.5), -math.log(0.9), 0.0]]))


def _rl_batch() -> StepBatch:
    gen = torch.Generator().manual_seed(0)
    return StepBatch(prompt_ids=PROMPTS[:4], response_ids=RESPONSES[:4], response_mask=MASKS[:4], rewards=REWARDS,
                     old_logprobs=[(-1.0 - torch.rand(len(r), generator=gen)).tolist() for r in RESPONSES[:4]],
                     group_ids=GROUPS)


def _expert_batch() -> StepBatch:
    return StepBatch(prompt_ids=PROMPTS[4:], response_ids=RESPONSES[4:])


def test_expert_rows_get_no_advantage_and_leave_the_sampled_rows_advantages_as_they_were():
    rl, algo = _rl_batch(), AlgorithmConfig(advantage="grpo")
    mixed = rl.with_expert_rows(_expert_batch(), MU)
    assert mixed.expert == [False] * 4 + [True] * 2 and mixed.expert_weight == MU
    assert len(set(mixed.group_ids)) == 4  # each expert row its own group: never in a sampled group's baseline
    alone, together = batch_advantages(rl, algo, None).advantages, batch_advantages(mixed, algo, None).advantages
    torch.testing.assert_close(together[:4, : alone.shape[1]], alone)
    assert together[4:].abs().sum() == 0 and together[:4, alone.shape[1]:].abs().sum() == 0


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    res = {}
    for name, batch, algo in (
            ("rl", _rl_batch(), AlgorithmConfig()),
            ("sft", _expert_batch(), AlgorithmConfig(policy_loss="sft")),
            ("chord", _rl_batch().with_expert_rows(_expert_batch(), MU), AlgorithmConfig(chord_phi=False)),
            ("chord_phi", _rl_batch().with_expert_rows(_expert_batch(), MU), AlgorithmConfig(chord_phi=True)),
            ("chord_packed", _rl_batch().with_expert_rows(_expert_batch(), MU), AlgorithmConfig(chord_phi=False))):
        optimizer = EveryStepOptimizer(model)
        budget = 16 if name == "chord_packed" else 0
        metrics = train_step(model, optimizer, batch, algo, 2, 0, max_tokens_per_microbatch=budget)
        res[name] = (metrics, optimizer.steps[0])
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("chord")))


def test_a_mixed_step_is_one_minus_mu_rl_plus_mu_sft_each_over_its_own_tokens(run):
    (rl_metrics, rl_grads), (sft_metrics, sft_grads) = run["rl"], run["sft"]
    for name in ("chord", "chord_packed"):
        metrics, grads = run[name]
        assert metrics["chord/mu"] == MU
        assert metrics["loss/chord_sft"] == pytest.approx(sft_metrics["loss/sft"], rel=1e-5)
        assert metrics["loss/chord_rl"] == pytest.approx(rl_metrics["loss/policy"], rel=1e-4, abs=1e-7)
        for param, grad in grads.items():
            torch.testing.assert_close(grad, (1 - MU) * rl_grads[param] + MU * sft_grads[param],
                                       rtol=1e-4, atol=1e-6)
    phi_metrics, phi_grads = run["chord_phi"]
    assert 0 < phi_metrics["loss/chord_sft"] < 0.25 * sft_metrics["loss/sft"]  # phi <= 1/4
    assert any(not torch.allclose(phi_grads[p], run["chord"][1][p]) for p in phi_grads)
