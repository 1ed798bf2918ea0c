"""Sequence packing (trainer.max_tokens_per_microbatch) on the tiny model with real megatron-core on
one CPU gloo rank (spawned): packed microbatches (rows back to back, each attending to itself through
cumulative sequence lengths) give the padded path's logprobs, entropy, losses and gradients to 1e-5; logits computed at the
response targets alone give what logits at every position gave; the token-budget microbatches
hold every row once within the budget; and DPO steps, packed by whole pairs, give the padded
step's loss and gradients and the loss computed by hand."""


import pytest
import torch

from rft.trainer.microbatches import microbatches, mini_batches
from tests.unit.one_rank import init_one_rank, run_one_rank

PROMPTS = [[1, 5, 6, 14, 7], [1, 12, 13], [1, 20, 21, 17, 30, 31, 3, 3], [1, 9], [1, 4, 4], [1, 15, 16, 17]]
RESPONSES = [[8, 9, 2], [2], [10, 11, 12, 13, 2, 7, 7], [4, 5], [6, 6, 6, 6, 2], [3, 2]]
MASKS = [[1, 1, 1], [1], [1, 1, 0, 0, 1, 1, 1], [1, 1], [1, 1, 1, 1, 1], [1, 1]]  # row 2: an observation
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.5, 1.0]
GROUPS = [0, 0, 1, 1, 2, 2]
BUDGET = 16  # tokens per packed microbatch
# DPO pairs: prompt i with response i chosen and response i-1 rejected (rows 2i, 2i+1), lengths 7..25
DPO_PROMPTS = [p for p in PROMPTS for _ in (0, 1)]
DPO_RESPONSES = [r for i, chosen in enumerate(RESPONSES) for r in (chosen, RESPONSES[i - 1])]
DPO_BETA, DPO_BUDGET = 0.5, 32


class CapturingOptimizer:
    """The optimizer contract, recording the gradients it would step on (fp32 model: p.grad)."""

    def __init__(self, model):
        self.model, self.param_groups, self.grads = model, [{"lr": 0.0}], None

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    def step(self, grad_clip: float):
        from rft.trainer.optimizer import StepResult

        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return StepResult(True, 0.0, 1.0)


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import (
        forward_logprobs,
        logprobs_from_logits,
        model_forward,
        pack_microbatch,
    )
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.pipeline import LogprobsHead
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    res = {}
    cpu = torch.device("cpu")
    with torch.no_grad():
        for packed in (False, True):
            mb = pack_microbatch(PROMPTS, RESPONSES, 0, cpu, MASKS, packed=packed)
            res[f"forward_{packed}"] = (*forward_logprobs(model, mb), mb.loss_mask, tuple(mb.input_ids.shape))
        padded = pack_microbatch(PROMPTS, RESPONSES, 0, cpu, MASKS)  # logits at every position, as before
        res["forward_every_position"] = logprobs_from_logits(model_forward(model, padded), padded)
    gen = torch.Generator().manual_seed(0)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, response_mask=MASKS, rewards=REWARDS,
                      old_logprobs=[(-1.0 - torch.rand(len(r), generator=gen)).tolist() for r in RESPONSES],
                      group_ids=GROUPS)
    for agg in ("token-mean", "seq-mean-token-mean"):
        algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", loss_agg=agg, entropy_coef=0.01)
        for budget in (0, BUDGET):
            optimizer = CapturingOptimizer(model)
            metrics = train_step(model, optimizer, batch, algo, 2, 0, max_tokens_per_microbatch=budget)
            res[f"step_{agg}_{budget}"] = (metrics, optimizer.grads)
    _dpo_steps(model, model_dir, geo, res)
    _fused_logprob_steps(model, batch, res)
    LogprobsHead.response_only = False  # the policy's logits at every position, as before
    optimizer = CapturingOptimizer(model)
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", loss_agg="token-mean", entropy_coef=0.01)
    metrics = train_step(model, optimizer, batch, algo, 2, 0)
    res["step_every_position"] = (metrics, optimizer.grads)
    torch.save(res, out)
    dist.destroy_process_group()


def _fused_logprob_steps(model, batch, res: dict) -> None:
    """trainer.logprob_chunk = 4: the output layer, logprobs and entropy 4 positions at a time
    (rft/trainer/chunked_logprob.py), padded and packed, with an entropy bonus in the loss."""
    from rft.config import AlgorithmConfig
    from rft.trainer.forward import fused_logprobs, model_forward, pack_microbatch
    from rft.trainer.chunks import model_chunks
    from rft.trainer.train_step import train_step

    for chunk in model_chunks(model):
        chunk.logprob_chunk = 4
    with torch.no_grad():
        mb = pack_microbatch(PROMPTS, RESPONSES, 0, torch.device("cpu"), MASKS)
        res["fused_forward"] = fused_logprobs(model_forward(model, mb, response_only=True, fused_chunk=4), mb)
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", loss_agg="token-mean", entropy_coef=0.01)
    for budget in (0, BUDGET):
        optimizer = CapturingOptimizer(model)
        res[f"fused_step_{budget}"] = (train_step(model, optimizer, batch, algo, 2, 0, max_tokens_per_microbatch=budget),
                                       optimizer.grads)
    for chunk in model_chunks(model):
        chunk.logprob_chunk = 0


def _dpo_steps(model, model_dir: str, geo, res: dict) -> None:
    """DPO steps padded (two pairs per microbatch) and packed, against a reference model apart from
    the policy, and both models' logprobs of every row for the loss by hand."""
    from rft.config import AlgorithmConfig
    from rft.trainer.dpo_step import dpo_step
    from rft.trainer.forward import forward_logprobs, pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch

    ref, _ = build_gpt_model(model_dir)
    load_hf_weights(ref, load_hf_state(model_dir), geo)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # margins that differ from pair to pair, not the 0 of policy = reference
        for param in ref.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
        every_row = pack_microbatch(DPO_PROMPTS, DPO_RESPONSES, 0, torch.device("cpu"))
        res["dpo_logprobs"] = (forward_logprobs(model, every_row)[0], forward_logprobs(ref, every_row)[0],
                               every_row.loss_mask)
    batch = StepBatch(prompt_ids=DPO_PROMPTS, response_ids=DPO_RESPONSES)
    algo = AlgorithmConfig(policy_loss="dpo", dpo_beta=DPO_BETA)
    for budget in (0, DPO_BUDGET):
        optimizer = CapturingOptimizer(model)
        metrics = dpo_step(model, optimizer, ref, batch, algo, 4, 0, max_tokens_per_microbatch=budget)
        res[f"dpo_{budget}"] = (metrics, optimizer.grads)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("packing")))


def test_packed_forward_equals_padded(run):
    pad_lp, pad_ent, pad_mask, pad_shape = run["forward_False"]
    pack_lp, pack_ent, pack_mask, pack_shape = run["forward_True"]
    total = sum(len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES))
    assert pack_shape == (1, total) and pad_shape == (6, 15)  # one row, no padding
    assert torch.equal(pad_mask, pack_mask)
    valid = torch.zeros_like(pad_mask, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        valid[i, len(p) - 1: len(p) + len(r) - 1] = True  # every response target, observations included
    torch.testing.assert_close(pack_lp[valid], pad_lp[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pack_ent[valid], pad_ent[valid], atol=1e-5, rtol=1e-5)
    assert (pack_lp[~valid] == 0).all() and (pad_lp[~valid] == 0).all()  # no logits computed there


def test_logits_at_the_response_targets_alone_give_what_every_positions_gave(run):
    """The policy computes logits where a response token is predicted, not over prompt and padding."""
    every_lp, every_ent = run["forward_every_position"]
    lp, ent, mask, _ = run["forward_False"]
    valid = torch.zeros_like(mask, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        valid[i, len(p) - 1: len(p) + len(r) - 1] = True
    torch.testing.assert_close(lp[valid], every_lp[valid], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent[valid], every_ent[valid], atol=1e-6, rtol=1e-6)
    assert (every_lp[~valid] != 0).any()  # the prompt's were computed before
    (response_only, grads), (every, every_grads) = run["step_token-mean_0"], run["step_every_position"]
    for key in ("loss/policy", "actor/entropy", "actor/clipfrac"):
        assert response_only[key] == pytest.approx(every[key], abs=1e-6), key
    for name, grad in every_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("budget", [0, BUDGET])
def test_the_chunked_output_layer_gives_the_logprobs_entropy_and_gradients_of_whole_logits(run, budget):
    """trainer.logprob_chunk: logits 4 positions at a time, recomputed in backward, never whole;
    the same logprobs, entropy, losses and gradients as from whole logits (padded and packed)."""
    lp, ent, _, _ = run["forward_False"]
    fused_lp, fused_ent = run["fused_forward"]
    torch.testing.assert_close(fused_lp, lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused_ent, ent, atol=1e-6, rtol=1e-6)
    _assert_same_step(run[f"fused_step_{budget}"], run[f"step_token-mean_{budget}"], atol=1e-6, rtol=1e-5)
    assert run[f"fused_step_{budget}"][1]["output_layer.weight"].abs().sum() > 0


def _assert_same_step(got: tuple, want: tuple, atol: float, rtol: float) -> None:
    """Two policy steps' (scalars, gradients) agree."""
    (metrics, grads), (want_metrics, want_grads) = got, want
    for key in ("loss/policy", "actor/entropy", "actor/clipfrac", "train/tokens"):
        assert metrics[key] == pytest.approx(want_metrics[key], abs=atol), key
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_step_gives_the_padded_losses_and_gradients(run, agg):
    _assert_same_step(run[f"step_{agg}_{BUDGET}"], run[f"step_{agg}_0"], atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in run[f"step_{agg}_0"][1].values())


def test_packed_dpo_step_gives_the_padded_loss_gradients_and_the_loss_by_hand(run):
    import torch.nn.functional as F

    policy, ref, mask = run["dpo_logprobs"]
    sums = lambda logprobs: (logprobs * mask).sum(dim=-1)  # noqa: E731
    margin = DPO_BETA * ((sums(policy) - sums(ref))[0::2] - (sums(policy) - sums(ref))[1::2])
    by_hand = -F.logsigmoid(margin).mean().item()
    assert margin.abs().min() > 1e-3  # no pair at ln 2: a pair split or swapped changes the loss
    (padded, pad_grads), (packed, pack_grads) = run["dpo_0"], run[f"dpo_{DPO_BUDGET}"]
    assert padded["loss/dpo"] == pytest.approx(by_hand, abs=1e-5)
    for key in ("loss/dpo", "dpo/accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-5), key
    assert pad_grads.keys() == pack_grads.keys() and any(g.abs().sum() > 0 for g in pad_grads.values())
    for name, grad in pad_grads.items():
        torch.testing.assert_close(pack_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_token_budget_microbatches_hold_every_row_once_within_the_budget():
    lengths = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)]  # 8, 4, 15, 4, 8, 6
    rows = list(range(len(lengths)))
    bins = microbatches(rows, lengths, 2, BUDGET)
    assert sorted(r for b in bins for r in b) == rows
    assert all(sum(lengths[r] for r in b) <= BUDGET for b in bins)
    assert len(bins) == 3  # 45 tokens in 16-token bins: first-fit decreasing leaves no fourth
    assert microbatches(rows, lengths, 2, 10)[0] == [2]  # longer than the budget: alone
    assert microbatches(rows, lengths, 4, 0) == [[0, 1, 2, 3], [4, 5]]  # no budget: row counts


def test_mini_batches_deal_each_optimizer_steps_rows_over_dp():
    assert mini_batches(6, 4, 0, 2) == [[0, 2], [4]]
    assert mini_batches(6, 4, 1, 2) == [[1, 3], [5]]
    assert mini_batches(6, 0, 0, 1) == [list(range(6))]

