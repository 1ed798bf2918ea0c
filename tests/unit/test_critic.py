"""PPO's critic on the tiny model with real megatron-core on one CPU rank (gloo, in a spawned
process so Megatron's global parallel state stays out of this one): one value per response token,
aligned and independent of padding; the trunk is the policy's; updates lower the value loss; a
PPO step feeds the critic's values to GAE and trains the critic towards GAE's returns; the state
round-trips through a checkpoint, optimizer included."""

import io
import os

import pytest
import torch

from rft.config import AlgorithmConfig
from tests.unit.one_rank import run_one_rank
from tests.unit.test_algorithms_advantages import ref_gae

# rows of varied lengths (row 1: a length-1 response), two microbatches of two rows each
PROMPTS = [[1, 5, 6, 14, 7], [1, 12, 13], [1, 20, 21, 17, 30, 31], [1, 9]]
RESPONSES = [[8, 9, 2], [2], [10, 11, 12, 13, 2], [4, 5]]
REWARDS = [1.0, 0.0, 1.0, 0.5]
ALGO = dict(advantage="gae", policy_loss="ppo", gamma=1.0, lam=0.95, critic_lr=1e-3, value_clip=0.2, lr=1e-4)


def _batch():
    from rft.trainer.step_batch import StepBatch

    return StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS,
                     old_logprobs=[[0.0] * len(r) for r in RESPONSES], group_ids=list(range(len(RESPONSES))))


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.trainer.critic import Critic
    from rft.trainer.forward import model_forward, pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, init_model_parallel, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.pipeline import forward_logprobs_pipelined
    from rft.trainer.step_batch import response_tensors, take_from_microbatch
    from rft.trainer.train_step import train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    init_model_parallel(1, seed=0)
    policy, geo = build_gpt_model(model_dir)
    load_hf_weights(policy, load_hf_state(model_dir), geo)
    algo = AlgorithmConfig(**ALGO)
    batch = _batch()
    chunks = [[0, 1], [2, 3]]
    mbs = [pack_microbatch([PROMPTS[i] for i in idx], [RESPONSES[i] for i in idx], 0, torch.device("cpu"))
           for idx in chunks]
    mask, _ = response_tensors(batch)
    res = {"mask": mask}

    critic = Critic.build(model_dir, "float32", policy, algo, seed=0)
    policy_state = policy.state_dict()
    res["trunk_is_policy"] = all(torch.equal(v, policy_state[k]) for k, v in critic.model.state_dict().items()
                                 if not k.startswith("output_layer.") and isinstance(v, torch.Tensor))
    res["head_params"] = sorted(n for n, _ in critic.model.named_parameters() if n.startswith("output_layer."))
    res["values"] = critic.values(batch, chunks, mbs)
    with torch.no_grad():  # each row alone, unpadded: the value at the position that predicts each token
        res["alone"] = [model_forward(critic.model, pack_microbatch([p], [r], 0, torch.device("cpu")))[0, len(p) - 1:
                        len(p) - 1 + len(r), 0] for p, r in zip(PROMPTS, RESPONSES)]

    # fixed targets (each row's reward on each of its tokens: the gamma = 1 Monte-Carlo return)
    target = torch.tensor(REWARDS)[:, None] * mask
    n_tok, n_seq = float(mask.sum()), float(len(PROMPTS))
    reported, measured = [], []
    for _ in range(8):
        old = critic.values(batch, chunks, mbs)
        measured.append(float((0.5 * (old - target) ** 2 * mask).sum() / n_tok))
        metrics = critic.update(batch, chunks, mbs, old, target, algo, n_tok, n_seq, norm_len=1)
        reported.append(metrics["critic/value_loss"])
    res["reported"], res["measured"], res["last_update"] = reported, measured, metrics

    # checkpoint round trip: a critic with another head, loaded from the state, then one more step each
    buf = io.BytesIO()
    torch.save(critic.state_dict(), buf)
    twin = Critic.build(model_dir, "float32", policy, algo, seed=1)
    res["twin_differs_before_load"] = not torch.allclose(twin.values(batch, chunks, mbs), critic.values(batch, chunks, mbs))
    buf.seek(0)
    twin.load_state_dict(torch.load(buf))
    for c in (critic, twin):
        c.update(batch, chunks, mbs, c.values(batch, chunks, mbs), target, algo, n_tok, n_seq, norm_len=1)
    res["after_resume"] = (critic.values(batch, chunks, mbs), twin.values(batch, chunks, mbs))

    # a whole PPO step: the policy's own logprobs as vLLM's (ratio 1), a fresh critic
    critic = Critic.build(model_dir, "float32", policy, algo, seed=0)
    logprobs = forward_logprobs_pipelined(policy, mbs)
    own = torch.zeros_like(mask)
    for idx, lp in zip(chunks, logprobs):
        take_from_microbatch(batch, idx, lp, own)
    batch.old_logprobs = [own[i, : len(r)].tolist() for i, r in enumerate(RESPONSES)]
    res["ppo_values_before"] = critic.values(batch, chunks, mbs)
    optimizer = build_optimizer(policy, lr=algo.lr)
    res["ppo_metrics"] = train_step(policy, optimizer, batch, algo, 2, 0, None, norm_len=8, critic=critic)
    res["ppo_values_after"] = critic.values(batch, chunks, mbs)
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("critic")))


def test_one_value_per_response_token_aligned_and_independent_of_padding(run):
    values, mask = run["values"], run["mask"]
    assert values.shape == (4, 5) == mask.shape
    assert (values[mask == 0] == 0).all() and torch.isfinite(values).all()
    for i, alone in enumerate(run["alone"]):
        torch.testing.assert_close(values[i, : len(RESPONSES[i])], alone, atol=1e-5, rtol=1e-5)
    assert values[mask == 1].std() > 0  # per-token values, not one constant


def test_trunk_is_the_policy_and_the_head_is_hidden_to_one(run):
    assert run["trunk_is_policy"]
    assert run["head_params"] == ["output_layer.head.bias", "output_layer.head.weight"]


def test_updates_lower_the_value_loss_on_a_fixed_batch(run):
    reported, measured = run["reported"], run["measured"]
    # the update's own loss (before its step) is 0.5 (V - R)^2 token-mean, measured independently
    for r, m in zip(reported, measured):
        assert r == pytest.approx(m, rel=1e-4, abs=1e-6)
    assert measured[-1] < 0.5 * measured[0], measured
    last = run["last_update"]
    assert 0.0 <= last["critic/vf_clipfrac"] <= 1.0 and last["critic/grad_norm"] > 0


def test_checkpoint_round_trip_restores_weights_and_optimizer(run):
    assert run["twin_differs_before_load"]
    a, b = run["after_resume"]
    # equal after one more step each: Adam's moments came back too (fresh ones would step elsewhere)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_ppo_step_feeds_critic_values_to_gae_and_trains_towards_its_returns(run):
    metrics, values, mask = run["ppo_metrics"], run["ppo_values_before"], run["mask"]
    for key in ("loss/policy", "actor/grad_norm", "critic/value_loss", "critic/vf_clipfrac", "critic/values_mean",
                "critic/grad_norm"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    n = float(mask.sum())
    _, returns = ref_gae(REWARDS, mask, values.tolist(), None, ALGO["gamma"], ALGO["lam"])
    returns = torch.tensor(returns)
    assert metrics["critic/values_mean"] == pytest.approx(float((values * mask).sum()) / n, abs=1e-6)
    assert metrics["critic/returns_mean"] == pytest.approx(float((returns * mask).sum()) / n, abs=1e-5)
    # the critic's loss before its step: 0.5 (V_old - GAE returns)^2, token-mean
    expected = float((0.5 * (values - returns) ** 2 * mask).sum()) / n
    assert metrics["critic/value_loss"] == pytest.approx(expected, rel=1e-4)
    after = run["ppo_values_after"]
    assert not torch.equal(after, values)  # the critic stepped
    assert float((0.5 * (after - returns) ** 2 * mask).sum()) / n < expected
