"""PPO's critic under TP=2, PP=2 (also with two virtual stages each) and DP=2 on gloo ranks scores and trains as on one rank (padded
microbatches, and packed ones under PP and TP).

A whole PPO step (train_step with a critic: values -> GAE -> policy step -> critic step) runs on
Llama (tied embeddings: the critic is built untied, its trunk copied from the policy's stage
shards) and Qwen3 (q/k norms, whose gradients are summed over TP). Values before and after the
step, and the step's critic and policy statistics, must equal the single-rank run's.
"""

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

PROMPTS = [[1, 5, 6, 14, 7], [1, 12, 13], [1, 20, 21, 17, 30, 31], [1, 9]]
RESPONSES = [[8, 9, 2], [2], [10, 11, 12, 13, 2], [4, 5]]
REWARDS = [1.0, 0.0, 1.0, 0.5]
KEYS = ("critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/returns_mean", "critic/grad_norm",
        "loss/policy", "actor/grad_norm")


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, out: str, budget: int = 0,
            vpp: int = 1) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.critic import Critic
    from rft.trainer.forward import pack_microbatch
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp, vpp)
    policy, geo = build_gpt_model(model_dir)
    load_hf_weights(policy, load_hf_state(model_dir), geo)
    algo = AlgorithmConfig(advantage="gae", policy_loss="ppo", gamma=1.0, lam=0.95, critic_lr=1e-3, value_clip=0.2,
                           lr=1e-3)
    critic = Critic.build(model_dir, "float32", policy, algo, seed=0)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS,
                      old_logprobs=[[-2.0] * len(r) for r in RESPONSES], group_ids=list(range(len(RESPONSES))))
    micro = 1  # several microbatches per DP rank, as train_step splits them
    rows = list(range(ps.get_data_parallel_rank(), len(PROMPTS), ps.get_data_parallel_world_size()))
    chunks = [rows[s: s + micro] for s in range(0, len(rows), micro)]
    mbs = [pack_microbatch([PROMPTS[i] for i in idx], [RESPONSES[i] for i in idx], 0, torch.device("cpu"))
           for idx in chunks]
    before = critic.values(batch, chunks, mbs)
    optimizer = build_optimizer(policy, lr=algo.lr)
    metrics = train_step(policy, optimizer, batch, algo, micro, 0, None, norm_len=8, critic=critic,
                         max_tokens_per_microbatch=budget)
    after = critic.values(batch, chunks, mbs)
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    if reporter:  # the trainer logs rank 0's metrics; the values live on the last stage
        torch.save({"before": before, "after": after, "metrics": metrics}, out)
    if rank == 0:
        torch.save(metrics, out + ".rank0")
    dist.destroy_process_group()


def _run(world: int, tp: int, pp: int, model_dir: str, out: str, budget: int = 0, vpp: int = 1) -> dict:
    spawn(_worker, world, tp, pp, free_port(), model_dir, out, budget, vpp)
    result = torch.load(out)
    result["rank0_metrics"] = torch.load(out + ".rank0")
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: create_family_model(f, str(root / f)) for f in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def one_rank(models, tmp_path_factory) -> dict[str, dict]:
    """The single-rank reference per family, run once for the module."""
    root = tmp_path_factory.mktemp("one_rank")
    return {f: _run(1, 1, 1, path, str(root / f"{f}.pt")) for f, path in models.items()}


@pytest.mark.parametrize("family, world, tp, pp, budget, vpp", [
    ("llama", 2, 2, 1, 0, 1), ("llama", 2, 1, 2, 0, 1), ("llama", 2, 1, 1, 0, 1), ("qwen3", 2, 2, 1, 0, 1),
    ("llama", 2, 1, 2, 12, 1), ("qwen3", 2, 2, 1, 12, 1),  # packed microbatches (12-token budget) too
    ("llama", 2, 1, 2, 0, 2)],  # two virtual stages per stage: the interleaved schedule, chunked models
    ids=["llama-tp2", "llama-pp2", "llama-dp2", "qwen3-tp2", "llama-pp2-packed", "qwen3-tp2-packed", "llama-pp2-vpp2"])
def test_critic_under_parallelism_equals_one_rank(models, one_rank, tmp_path, family, world, tp, pp, budget, vpp):
    one = one_rank[family]
    par = _run(world, tp, pp, models[family], str(tmp_path / "par.pt"), budget, vpp)
    torch.testing.assert_close(par["before"], one["before"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(par["after"], one["after"], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(one["after"], one["before"])  # the critic stepped
    for metrics in (par["metrics"], par["rank0_metrics"]):  # under PP rank 0 gets the sums too
        for key in KEYS:
            assert metrics[key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
