"""PPO epochs and mini-batches (algorithm.ppo_epochs, mini_batch_size) on the tiny model with real
megatron-core on one CPU gloo rank (spawned): 2 epochs x 2 mini-batches give 4 optimizer steps on
one rollout batch, the ratio is measured against the logprobs fixed before the first, clipping
acts after the first step, and every step's loss and the final weights equal a hand-rolled PPO
loop (rows one at a time, unpadded; GRPO advantages and the clipped surrogate written out here;
torch AdamW)."""


import pytest
import torch

from tests.unit.one_rank import init_one_rank, run_one_rank

PROMPTS = [[1, 5, 6, 14], [1, 12, 13], [1, 20, 21, 17, 30], [1, 9], [1, 3, 4], [1, 22], [1, 8, 8, 9], [1, 40]]
RESPONSES = [[8, 9, 2], [2, 7], [10, 11, 12, 2], [4, 5], [6, 2], [7, 7, 3], [5], [9, 10, 2]]
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]  # rows 2i and 2i+1 answer one task
EPOCHS, MINI_BATCH, LR, CLIP = 2, 4, 3e-3, 0.2


def _grpo_advantages() -> list[float]:
    out = []
    for i, g in enumerate(GROUPS):
        group = torch.tensor([r for r, h in zip(REWARDS, GROUPS) if h == g])
        out.append(float((REWARDS[i] - group.mean()) / (group.std() + 1e-6)))
    return out


def _row_logprobs(model, i: int) -> torch.Tensor:
    """Logprobs of row i's response tokens, the row alone (no padding)."""
    from rft.trainer.forward import forward_logprobs, pack_microbatch

    mb = pack_microbatch([PROMPTS[i]], [RESPONSES[i]], 0, torch.device("cpu"))
    logprobs, _ = forward_logprobs(model, mb, with_entropy=False)
    p = len(PROMPTS[i])
    return logprobs[0, p - 1: p - 1 + len(RESPONSES[i])]


def _reference_loop(model, old: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """PPO as the papers write it: per mini-batch, token-mean of -min(r A, clip(r) A) over its tokens."""
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.0)
    advantages = _grpo_advantages()
    losses, clipfracs = [], []
    for _ in range(EPOCHS):
        for start in range(0, len(PROMPTS), MINI_BATCH):
            rows = range(start, start + MINI_BATCH)
            adamw.zero_grad()
            tokens = sum(len(RESPONSES[i]) for i in rows)
            loss, clipped = 0.0, 0.0
            for i in rows:
                ratio = torch.exp(_row_logprobs(model, i) - old[i])
                plain, bounded = ratio * advantages[i], ratio.clamp(1 - CLIP, 1 + CLIP) * advantages[i]
                loss = loss - torch.minimum(plain, bounded).sum() / tokens
                clipped += float((bounded < plain).float().sum()) / tokens  # the clip binds (verl's pg_clipfrac)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            adamw.step()
            losses.append(float(loss))
            clipfracs.append(clipped)
    return losses, clipfracs


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    hf = load_hf_state(model_dir)
    models = []
    for _ in range(2):
        model, geo = build_gpt_model(model_dir)
        load_hf_weights(model, hf, geo)
        models.append(model)
    ours, reference = models
    with torch.no_grad():  # the sampler's logprobs: the policy's own, nudged so ratios start near 1
        gen = torch.Generator().manual_seed(0)
        old = [_row_logprobs(ours, i) + 0.01 * torch.randn(len(RESPONSES[i]), generator=gen)
               for i in range(len(PROMPTS))]
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS,
                      old_logprobs=[o.tolist() for o in old], group_ids=GROUPS)
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", ppo_epochs=EPOCHS, mini_batch_size=MINI_BATCH,
                           lr=LR, clip_eps=CLIP, grad_clip=1.0)
    steps: list[dict] = []
    metrics = train_step(ours, build_optimizer(ours, lr=LR), batch, algo, 3, 0, per_optimizer_step=steps)
    ref_losses, ref_clipfracs = _reference_loop(reference, old)
    torch.save({"metrics": metrics, "steps": steps, "ref_losses": ref_losses, "ref_clipfracs": ref_clipfracs,
                "weights": [p.detach().clone() for p in ours.parameters()],
                "ref_weights": [p.detach().clone() for p in reference.parameters()]}, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("ppo_epochs")))


def test_two_epochs_of_two_mini_batches_are_four_optimizer_steps(run):
    assert len(run["steps"]) == 4 and run["metrics"]["train/optimizer_steps"] == 4
    assert run["metrics"]["train/tokens"] == sum(len(r) for r in RESPONSES)  # the batch's, counted once
    assert run["metrics"]["actor/step_skipped"] == 0


def test_clipping_acts_after_the_first_step(run):
    clipfracs = [s["actor/clipfrac"] for s in run["steps"]]
    assert clipfracs[0] == 0  # the ratios start within 1 +- clip (old = own logprobs +- 0.01)
    assert max(clipfracs[1:]) > 0, clipfracs


def test_every_step_matches_a_hand_rolled_ppo_loop(run):
    ours = [s["loss/policy"] for s in run["steps"]]
    assert ours == pytest.approx(run["ref_losses"], abs=1e-5)
    assert [s["actor/clipfrac"] for s in run["steps"]] == pytest.approx(run["ref_clipfracs"], abs=1e-6)
    # AdamW divides by sqrt(v): on an element whose gradient is nearly 0, padded vs unpadded float
    # rounding moves the update by a visible part of lr (measured: at most 1.2e-5, lr 3e-3)
    for mine, theirs in zip(run["weights"], run["ref_weights"]):
        torch.testing.assert_close(mine, theirs, atol=LR / 60, rtol=1e-4)
    # the means over the optimizer steps are what the trainer step logs
    assert run["metrics"]["loss/policy"] == pytest.approx(sum(ours) / 4, abs=1e-7)
