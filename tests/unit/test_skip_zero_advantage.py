"""trainer.skip_zero_advantage_rows on the tiny model (real megatron-core, one CPU gloo rank):
rows whose advantages are all 0 (groups whose samples scored alike) are left out of the forward,
and the update is the full batch's: the same gradients, the same policy loss, padded and packed,
over PPO epochs and mini-batches; a loss term that does reach those rows (an entropy bonus)
keeps them in; a mini-batch with no row left takes no optimizer step."""

import pytest
import torch

from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_packing import MASKS, PROMPTS, RESPONSES

REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # group 1 all right, group 2 all wrong: 4 rows of advantage 0
GROUPS = [0, 0, 1, 1, 2, 2]
CASES = {  # name: (algorithm overrides, token budget, rewards)
    "padded": ({}, 0, REWARDS),
    "packed": ({}, 16, REWARDS),
    "epochs": ({"ppo_epochs": 2, "mini_batch_size": 3}, 0, REWARDS),
    "entropy": ({"entropy_coef": 0.01}, 0, REWARDS),
    "all_alike": ({}, 0, [1.0] * 6),  # no row left to forward
    # mini-batches of rows 0-2 and 3-5: groups 0 and 1 scored alike, so the first has no row to train
    "idle_mini_batch": ({"ppo_epochs": 2, "mini_batch_size": 3}, 0, [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
}


class EveryStepOptimizer:
    """The optimizer contract, recording the gradients of every optimizer step (zeros where no
    loss reached a parameter, as rft's optimizers take them) and never changing the weights."""

    def __init__(self, model):
        self.model, self.param_groups, self.steps = model, [{"lr": 0.0}], []

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    def step(self, grad_clip: float):
        from rft.trainer.optimizer import StepResult

        self.steps.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for n, p in self.model.named_parameters()})
        return StepResult(True, 0.0, 1.0)


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    gen = torch.Generator().manual_seed(0)
    old_logprobs = [(-1.0 - torch.rand(len(r), generator=gen)).tolist() for r in RESPONSES]
    res = {"parameters": sum(p.numel() for p in model.parameters())}
    for name, (overrides, budget, rewards) in CASES.items():
        batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, response_mask=MASKS, rewards=rewards,
                          old_logprobs=old_logprobs, group_ids=GROUPS)
        algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", loss_agg="token-mean", **overrides)
        for skip in (False, True):
            optimizer = EveryStepOptimizer(model)
            forwards = []
            handle = model.register_forward_hook(lambda _m, _a, out: forwards.append(out.shape[1]))
            logged: list[dict] = []  # the per-optimizer-step scalars the trainer logs
            metrics = train_step(model, optimizer, batch, algo, 2, 0, max_tokens_per_microbatch=budget,
                                 skip_zero_advantage=skip, per_optimizer_step=logged)
            metrics["steps_logged"] = len(logged)
            handle.remove()
            res[name, skip] = (metrics, optimizer.steps, forwards)
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("skip_zero_advantage")))


@pytest.mark.parametrize("case", ["padded", "packed", "epochs"])
def test_rows_of_zero_advantage_are_skipped_and_the_update_is_the_same(run, case):
    (full, full_steps, full_forwards), (skipping, steps, forwards) = run[case, False], run[case, True]
    assert "train/rows_skipped" not in full
    assert skipping["train/rows_skipped"] == 4
    assert skipping["train/tokens"] == full["train/tokens"]  # the batch's, skipped rows included
    assert full["train/optimizer_steps"] == len(full_steps) == len(steps) + skipping["train/steps_without_gradient"]
    assert skipping["train/optimizer_steps"] == len(steps)
    assert sum(forwards) < sum(full_forwards)  # fewer positions went through the model
    assert skipping["loss/policy"] == pytest.approx(full["loss/policy"], abs=1e-7)
    # the full run's steps with a gradient (a mini-batch of rows scored alike has none, and the
    # skipping run takes no step for it)
    trained = [step for step in full_steps if any(g.any() for g in step.values())]
    assert len(trained) == len(steps)
    for grads, full_grads in zip(steps, trained):
        for name, grad in full_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    assert any(g.abs().sum() > 0 for g in steps[0].values())


def test_a_loss_term_on_every_row_keeps_them_all(run):
    (full, full_steps, full_forwards), (skipping, steps, forwards) = run["entropy", False], run["entropy", True]
    assert "train/rows_skipped" not in skipping
    assert forwards == full_forwards
    assert skipping["actor/entropy"] == full["actor/entropy"]
    for name, grad in full_steps[0].items():
        torch.testing.assert_close(steps[0][name], grad, atol=0, rtol=0, msg=name)


def test_a_batch_without_a_row_to_train_takes_no_optimizer_step(run):
    """Every row's gradient is 0: the full batch's step would only move Adam's stale momentum, so
    with the skip there is no step at all (the run without it keeps its zero-gradient step)."""
    (full, full_steps, _), (skipping, steps, forwards) = run["all_alike", False], run["all_alike", True]
    assert skipping["train/rows_skipped"] == 6 and forwards == []
    assert steps == [] and skipping["train/optimizer_steps"] == 0 and skipping["train/steps_without_gradient"] == 1
    assert len(full_steps) == 1 and all(not g.any() for g in full_steps[0].values())
    assert "actor/entropy" not in skipping and "actor/entropy" in full  # not a misleading 0
    assert skipping["loss/policy"] == full["loss/policy"] == 0


def test_only_the_mini_batches_without_a_row_to_train_are_left_out(run):
    (full, full_steps, _), (skipping, steps, _) = run["idle_mini_batch", False], run["idle_mini_batch", True]
    assert len(full_steps) == 4 and len(steps) == 2  # 2 epochs x 2 mini-batches; the first of each idle
    assert skipping["train/steps_without_gradient"] == 2 and skipping["train/optimizer_steps"] == 2
    assert skipping["steps_logged"] == 2 and full["steps_logged"] == 4  # a step not taken is not logged as one
    assert skipping["loss/policy"] == pytest.approx(full["loss/policy"], abs=1e-7)  # means over the mini-batches
    assert all(not g.any() for g in full_steps[0].values()) and all(not g.any() for g in full_steps[2].values())
    for mine, theirs in ((steps[0], full_steps[1]), (steps[1], full_steps[3])):
        assert any(g.any() for g in theirs.values())
        for name, grad in theirs.items():
            torch.testing.assert_close(mine[name], grad, atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.parametrize("case, skip, rows, passes", [
    ("padded", False, range(6), 1), ("padded", True, [0, 1], 1), ("packed", True, [0, 1], 1),
    ("epochs", True, [0, 1], 2), ("epochs", False, range(6), 2), ("all_alike", True, [], 1)])
def test_model_flops_count_the_tokens_of_the_rows_trained(run, case, skip, rows, passes):
    """6 FLOPs per parameter per prompt or response token forwarded and backpropagated, per PPO
    epoch; rows left out and padding are not work the model did (rft/trainer/flops.py)."""
    tokens = sum(len(PROMPTS[i]) + len(RESPONSES[i]) for i in rows)
    assert run[case, skip][0]["train/model_flops"] == 6 * run["parameters"] * tokens * passes


def test_a_step_moved_the_weights_only_if_it_took_an_optimizer_step_it_did_not_skip():
    """The trainer syncs weights only after a step that changed them (rft/trainer/trainer.py)."""
    from rft.trainer.trainer import changed_weights

    assert not changed_weights({"train/optimizer_steps": 0.0, "actor/step_skipped": 0.0})  # no row had a gradient
    assert not changed_weights({"train/optimizer_steps": 2.0, "actor/step_skipped": 2.0})  # both non-finite
    assert changed_weights({"train/optimizer_steps": 2.0, "actor/step_skipped": 1.0})
    assert changed_weights({"loss/sft": 0.5})  # a step that does not say (SFT): taken as a change
